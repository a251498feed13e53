"""The eval stage with a tensor-parallel target (`eval.tensor_parallel: 2` under torchrun, gloo on the
CPU): the embedded target sharded over two ranks, a draft on each; speculative greedy decoding gives
exactly the sharded target's own greedy decoding on every prompt."""
import json
import shutil
import subprocess
import sys

import yaml
from transformers import AutoModelForCausalLM

from deepspec.data.servers import free_port
from tests.cache.test_tensor_parallel import embedded  # noqa: F401  (the fixture)
from tests.conftest import REPO, SAMPLE_CONVERSATIONS, project_env
from tests.evaluate.test_specdec import random_draft


def test_a_sharded_target_decodes_speculatively_exactly_as_it_decodes_plainly(tmp_path, embedded):  # noqa: F811
    work = tmp_path / "work"
    (work / "data" / "split").mkdir(parents=True)
    shutil.copytree(embedded, work / "data" / "target")
    target = AutoModelForCausalLM.from_pretrained(embedded)
    draft = random_draft(target, [1, 17, 33])
    draft.config.target = json.loads((embedded / "identity.json").read_text())
    draft.save(work / "data" / "draft")
    prompts = [{"id": str(i), "turns": [c[0]["content"]]} for i, c in enumerate(SAMPLE_CONVERSATIONS[:3])]
    (work / "data" / "split" / "eval.jsonl").write_text("".join(json.dumps(p) + "\n" for p in prompts))
    params = yaml.safe_load((REPO / "params.yaml").read_text())
    params["eval"] = dict(params["eval"], suites=[{"source": "heldout", "max_prompts": 3}], max_new_tokens=16,
                          sample=False, tensor_parallel=2, launcher="torchrun --nproc-per-node 2")
    (work / "params.yaml").write_text(yaml.safe_dump(params))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
           str(REPO / "stages" / "eval.py")]
    proc = subprocess.run(cmd, cwd=work, env=project_env(REPO, DEEPSPEC_LOG="WARNING", OMP_NUM_THREADS="1"),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [json.loads(line) for line in (work / "data" / "eval" / "prompts.jsonl").read_text().splitlines()]
    assert len(rows) == 3 and all(r["greedy_match"] for r in rows)
    assert all(r["new_tokens"] > 0 for r in rows)
