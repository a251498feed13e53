"""docs/gpu-recipe.md, walked command by command on 2 CPU cores.

Every command in the recipe's bash blocks and its params block must be handled below: run as
written, run with a stated stand-in, or skipped with the reason. A command added to the recipe
fails this test until it is walked. Stand-ins:
- the hub: a local hub cache holding `Qwen/Qwen3-4B` (a random model with Qwen3-4B's 36 layers, width
  32) and `mlabonne/open-perfectblend` (a small Parquet split) in huggingface_hub's layout; offline on;
- sglang (GPU-only): the `transformers serve` the regen stage starts (`regen.backend: transformers`);
- S3 for the DVC remote: moto_server on 127.0.0.1; the cache itself stays local (the S3 cache and its
  store naming have their own tests under tests/cache);
- sizes: a handful of rows, a few tokens and steps, `python` for the `torchrun` launchers.
"""
from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.conftest import REPO, SAMPLE_CONVERSATIONS, make_model_dir, project_env

RECIPE = REPO / "docs" / "gpu-recipe.md"
COMMIT = "0123456789abcdef0123456789abcdef01234567"

# What a 2-core test can afford, applied over the recipe's own params block.
SMALL = {
    "sampling": {"max_tokens": 6},
    "regen": {"backend": "transformers", "urls": [], "concurrency": 4, "timeout_s": 300},
    "cache": {"launcher": "python", "url": "data/cache.zarr"},
    "train": {"launcher": "python", "draft_layers": 1, "markov_rank": 16, "anchors_per_sample": 8,
              "grad_accum": 1, "warmup_steps": 1, "steps": 4, "checkpoint_every": 2, "num_workers": 0},
    "eval": {"max_new_tokens": 6},
}
SMALL_SUITE = {"max_prompts": 1}  # over each of the recipe's eval suites


def recipe_blocks(text: str) -> list[tuple[str, str, str]]:
    """(section heading, language, body) of every fenced block, in order."""
    blocks, section = [], ""
    for m in re.finditer(r"^(#+ [^\n]*)$|^```(\w*)\n(.*?)^```$", text, re.M | re.S):
        if m.group(1):
            section = m.group(1).lstrip("# ")
        else:
            blocks.append((section, m.group(2), m.group(3)))
    return blocks


def bash_commands(body: str) -> list[str]:
    """One string per command: continuation lines joined, comments and blank lines dropped."""
    commands, current = [], ""
    for line in body.splitlines():
        line = re.sub(r"(^|\s)#.*$", "", line).rstrip()
        if line.endswith("\\"):
            current += line[:-1] + " "
            continue
        current += line
        if current.strip():
            commands.append(current.strip())
        current = ""
    return commands


def hub_snapshot(cache: Path, kind: str, repo: str) -> Path:
    root = cache / f"{kind}s--{repo.replace('/', '--')}"
    (root / "refs").mkdir(parents=True, exist_ok=True)
    (root / "refs" / "main").write_text(COMMIT)
    return root / "snapshots" / COMMIT


def fill_hub_cache(cache: Path) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    model = make_model_dir(hub_snapshot(cache, "model", "Qwen/Qwen3-4B"), num_layers=36, hidden=32)
    data = hub_snapshot(cache, "dataset", "mlabonne/open-perfectblend") / "data"
    data.mkdir(parents=True)
    rows = [{"conversations": [{"from": "human" if t["role"] == "user" else "gpt", "value": t["content"]}
                               for t in conv], "source": "recipe-test"} for conv in SAMPLE_CONVERSATIONS[::3]]
    pq.write_table(pa.Table.from_pylist(rows), data / "train-00000-of-00001.parquet")
    return model


class Walk:
    def __init__(self, repo: Path, env: dict, moto):
        self.repo, self.env, self.moto = repo, env, moto
        self.log: list[tuple[str, str, float]] = []  # (command, what was done, seconds)

    def sh(self, command: str, timeout: float = 1800) -> str:
        proc = subprocess.run(["bash", "-c", command], cwd=self.repo, env=self.env, text=True, timeout=timeout,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        assert proc.returncode == 0, f"{command} exited {proc.returncode}:\n{proc.stdout[-6000:]}"
        return proc.stdout

    # ---- handlers: (command) -> None ---------------------------------------------------------------

    def export(self, command: str) -> None:
        # the recipe's values with the test's stand-ins: no network (offline, the local hub cache) and
        # moto's credentials
        for assignment in shlex.split(command)[1:]:
            name, _, value = assignment.partition("=")
            if name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
                value = "1"
            elif name.startswith("AWS_") and name in self.moto.env:
                value = self.moto.env[name]
            elif value.endswith("..."):  # a placeholder (HF_TOKEN=hf_...): nothing to stand in for offline
                continue
            self.env[name] = value

    def remote_add(self, command: str) -> None:
        url = shlex.split(command)[-1]
        self.moto.bucket(url.removeprefix("s3://").split("/")[0])
        self.sh(command)
        self.sh(f"dvc remote modify store endpointurl {self.moto.endpoint}")  # moto is not AWS

    def print_only(self, command: str) -> None:
        out = self.sh(command)
        assert out.count("sglang.launch_server") == 8 and "sglang_router.launch_router" in out, out

    def repro(self, command: str) -> None:
        out = self.sh(command)
        for stage in ("split", "target", "regen", "cache", "train", "eval"):
            assert f"Running stage '{stage}'" in out, out[-3000:]

    def push(self, command: str) -> None:
        self.sh(command)
        s3 = self.moto.client()
        assert s3.list_objects_v2(Bucket="my-bucket").get("KeyCount", 0) > 0

    def exp_run(self, command: str) -> None:
        out = self.sh(command)
        ran = {s for s in ("split", "target", "regen", "cache", "train", "eval") if f"Running stage '{s}'" in out}
        assert ran == {"cache", "train", "eval"}, out[-3000:]
        layers = json.loads((self.repo / "data/cache.zarr/zarr.json").read_text())["attributes"]["layers"]
        assert layers == [9, 25]

    def run(self, command: str) -> None:
        self.sh(command)

    def handlers(self):
        skip = "skip"
        return [
            (r"^python3 -m venv ~/sglang-env$", skip, "sglang is GPU-only: transformers serve stands in"),
            (r"^~/sglang-env/bin/pip install ", skip, "sglang is GPU-only: transformers serve stands in"),
            (r"^export ", self.export, "environment (offline on, moto credentials)"),
            (r"^dvc remote add -d store s3://", self.remote_add, "on moto (endpointurl added)"),
            (r"^dvc remote modify --local store ", self.run, "as written"),
            (r"^\.venv/bin/deepspec serve sglang .*--print-only$", self.print_only, "as written"),
            (r"^\.venv/bin/deepspec serve sglang ", skip, "needs 8 GPUs: regen.backend transformers stands in"),
            (r"^make setup$", skip, "the clone's .venv links to the environment the test runs in"),
            (r"^\. \.venv/bin/activate$", skip, "the test's PATH already starts with the .venv's bin"),
            (r"^dvc repro$", self.repro, "as written"),
            (r"^dvc push$", self.push, "to moto"),
            (r"^dvc exp run -S 'layers=\[9,25\]'$", self.exp_run, "as written"),
            (r"^dvc exp run -S train.capture=read-through .*-S train.capture_ranks=", skip,
             "needs 8 GPUs: tests/train/test_read_through.py runs capture ranks under torchrun"),
            (r"^dvc exp run -S cache.tensor_parallel=", skip,
             "needs 8 GPUs: tests/cache/test_tensor_parallel.py and tests/evaluate/test_eval_tensor_parallel.py "
             "run these stages sharded under torchrun (gloo), k = 2 and 3"),
            (r"^dvc exp show ", self.run, "as written"),
            (r"^deepspec cache estimate ", self.run, "as written"),
        ]

    def walk(self, command: str) -> None:
        matches = [(h, why) for pattern, h, why in self.handlers() if re.search(pattern, command)]
        assert matches, f"docs/gpu-recipe.md command not walked by this test: {command!r}"
        handler, why = matches[0]
        t0 = time.time()
        if handler != "skip":
            handler(command)
        self.log.append((command, why, round(time.time() - t0, 1)))
        print(f"{self.log[-1][2]:7.1f}s  {command}  [{why}]")


def apply_params(repo: Path, recipe: dict) -> None:
    from deepspec.params import params_from_dict

    params = yaml.safe_load((repo / "params.yaml").read_text())
    for section, values in recipe.items():
        params[section] = params[section] | values if isinstance(values, dict) else values
    params_from_dict(params)  # the recipe's block is valid params as written
    for section, values in SMALL.items():
        params[section] |= values
    params["eval"]["suites"] = [suite | SMALL_SUITE for suite in params["eval"]["suites"]]
    (repo / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))


@pytest.mark.slow
@pytest.mark.timeout(3600)  # 8.4 min measured on 2 cores shared with ~6 other test runs (load 11)
def test_the_gpu_recipe_runs_command_by_command(project, moto, tmp_path):
    from deepspec.models.target import identity

    hub = tmp_path / "hub"
    model = fill_hub_cache(hub)
    env = project_env(project, HF_HOME=str(tmp_path / "hf_home"), HF_HUB_CACHE=str(hub))
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "AWS_ENDPOINT_URL"):
        env.pop(var, None)
    # `make setup` (skipped: it would reinstall into the shared environment) leaves a .venv in the clone
    (project / ".venv").symlink_to(Path(sys.executable).parent.parent, target_is_directory=True)
    walk = Walk(project, env, moto)
    params_blocks = 0
    for section, lang, body in recipe_blocks(RECIPE.read_text()):
        if lang == "bash":
            for command in bash_commands(body):
                walk.walk(command)
        elif lang == "yaml" and "sampling" in (parsed := yaml.safe_load(body)):
            apply_params(project, parsed)
            params_blocks += 1
        # the other yaml blocks are dvc.yaml snippets for a cache on S3 (tested under tests/cache)
    assert params_blocks == 1
    assert walk.env["HF_HUB_OFFLINE"] == "1" and "AWS_SECRET_ACCESS_KEY" in walk.env
    # the target came from the hub cache as `hf:Qwen/Qwen3-4B`, the data as `hf:mlabonne/open-perfectblend`
    fetched = json.loads((project / "data/target/identity.json").read_text())
    assert fetched == identity(model) and fetched["num_layers"] == 36
    report = json.loads((project / "data/split/report.json").read_text())
    assert "open-perfectblend" in json.dumps(report)
    done = [c for c, _, _ in walk.log]
    assert "dvc repro" in done and "dvc push" in done


def test_recipe_parser_sees_every_command():
    text = "# A\n```bash\nexport X=1 \\\n  Y=2   # comment\n\n# only a comment\nls -l\n```\n## B\n```yaml\na: 1\n```\n"
    blocks = recipe_blocks(text)
    assert blocks == [("A", "bash", "export X=1 \\\n  Y=2   # comment\n\n# only a comment\nls -l\n"),
                      ("B", "yaml", "a: 1\n")]
    assert [" ".join(c.split()) for c in bash_commands(blocks[0][2])] == ["export X=1 Y=2", "ls -l"]


def test_recipe_states_the_environment_a_user_needs():
    text = RECIPE.read_text()
    for var in ("HF_TOKEN", "HF_HUB_OFFLINE=0", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY",
                "AWS_EC2_METADATA_DISABLED", "AWS_ENDPOINT_URL"):
        assert var in text, var
