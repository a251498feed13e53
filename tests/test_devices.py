"""Device discipline, checked on the CPU: the rules that keep the CUDA path right by construction, and
each GPU-path defect's logic (generators on the data's device, one distributed set-up, the accelerator
chosen when present, host copies waited for off the compute thread, no process-wide AWS switch)."""
import ast
import os
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from deepspec.devices import HostCopies, draw, generator, local_device, separate_writer, writer_threads
from tests.conftest import REPO

# Library and stage code. The embedded default's toy trainer (deepspec/embedded) is the one exception:
# it builds the shipped CPU target and never meets a user's tensors.
CODE = [p for p in sorted((REPO / "deepspec").rglob("*.py")) if "embedded" not in p.parts] + \
    sorted((REPO / "stages").glob("*.py"))
FACTORIES = {"tensor", "as_tensor", "zeros", "ones", "full", "empty", "arange", "linspace", "eye", "rand", "randn",
             "randint", "randperm", "Generator"}
DISTRIBUTED = {"init_process_group", "destroy_process_group", "set_device", "broadcast_object_list",
               "all_gather_object"}


def calls(path: Path):
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Call):
            yield node


def dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Attribute):
        return f"{dotted(node.value)}.{node.attr}"
    return node.id if isinstance(node, ast.Name) else "?"


def where(path: Path, node: ast.Call) -> str:
    return f"{path.relative_to(REPO)}:{node.lineno}"


def test_every_tensor_factory_and_generator_names_its_device():
    """A factory or generator without `device=` lands on the CPU whatever the data it meets is on (the
    eval's CPU generators met CUDA probabilities). Host tensors say so: device="cpu"."""
    bad = [f"{where(p, c)} {dotted(c.func)}" for p in CODE for c in calls(p)
           if dotted(c.func) in {f"torch.{f}" for f in FACTORIES} and not any(k.arg == "device" for k in c.keywords)]
    assert bad == []


def test_draws_and_cuda_devices_come_from_deepspec_devices_only():
    bad = []
    for p in CODE:
        if p.name == "devices.py":
            continue
        for c in calls(p):
            name = dotted(c.func)
            if name.endswith(".cuda") or name == "torch.multinomial":
                bad.append(f"{where(p, c)} {name}")
            if name == "torch.device" and c.args and isinstance(c.args[0], ast.Constant) and c.args[0].value == "cuda":
                bad.append(f"{where(p, c)} torch.device('cuda')")
    assert bad == []


def test_the_distributed_set_up_is_made_in_one_place_and_every_torchrun_stage_uses_it():
    """The cache stage made its own process group and never called set_device (every rank on GPU 0);
    the train stage's copy did: one helper now, used by both."""
    made = sorted({where(p, c).split(":")[0] for p in CODE for c in calls(p) if dotted(c.func).split(".")[-1] in DISTRIBUTED})
    assert made == ["deepspec/distributed.py"]
    for stage in ("cache", "train"):
        tree = ast.parse((REPO / "stages" / f"{stage}.py").read_text())
        assert any(isinstance(n, ast.ImportFrom) and n.module == "deepspec.distributed" and
                   "launch" in [a.name for a in n.names] for n in ast.walk(tree)), stage
    for stage in ("eval", "regen"):  # one process each: the process's accelerator
        assert "local_device()" in (REPO / "stages" / f"{stage}.py").read_text(), stage


def test_local_device_is_the_local_ranks_gpu_when_cuda_is_present(monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert local_device() == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert local_device() == torch.device("cuda", 3)
    monkeypatch.delenv("LOCAL_RANK")
    assert local_device() == torch.device("cuda", 0)


def test_a_cache_writer_beside_a_gpu_writes_on_the_ranks_share_of_the_cores(monkeypatch):
    """On the CPU one thread (the forward passes use every core); beside a GPU the process's cores,
    shared with the node's other ranks, less its own thread, at most 8, at least 1."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert writer_threads("cpu") == 1
    assert writer_threads(torch.device("cuda", 0)) == 8
    for ranks, threads in (("2", 7), ("4", 3), ("8", 1), ("16", 1), ("32", 1)):
        monkeypatch.setenv("LOCAL_WORLD_SIZE", ranks)
        assert writer_threads("cuda:1") == threads, ranks
    assert writer_threads("cpu") == 1


def test_the_default_loading_processes_by_device_and_the_ranks_share_of_the_cores(monkeypatch):
    from deepspec.devices import loader_workers

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)))
    assert loader_workers("auto", "cpu") == 0 and loader_workers(3, "cpu") == 3 and loader_workers(0, "cuda") == 0
    for ranks, want in (("1", 4), ("4", 3), ("8", 1), ("16", 1)):
        monkeypatch.setenv("LOCAL_WORLD_SIZE", ranks)
        assert loader_workers("auto", torch.device("cuda", 0)) == want, ranks


def test_a_cache_writer_beside_a_gpu_writes_in_a_process_of_its_own(monkeypatch):
    """Beside a GPU the forward passes' Python must not wait for a writer thread's GIL
    (benchmarks/writeback_gil.py); on the CPU a thread; without memory files (not Linux) a thread."""
    assert not separate_writer("cpu")
    assert separate_writer(torch.device("cuda", 0)) and separate_writer("cuda:1")
    monkeypatch.delattr(os, "memfd_create")
    assert not separate_writer("cuda")


def test_launch_makes_the_local_gpu_current_before_any_collective(monkeypatch):
    import deepspec.distributed as distributed

    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    current = []
    monkeypatch.setattr(torch.cuda, "set_device", current.append)
    with distributed.launch(60) as d:
        assert current == [torch.device("cuda", 1)] and d.device == torch.device("cuda", 1)
        assert (d.rank, d.world, d.share(5), d.gather(5)) == (0, 1, 5, [5])


def _wait_in_the_trainers_group(rank: int, port: int, out: str) -> None:
    """One of 3 gloo ranks, split into 2 trainers and 1 capture rank: trainer 0 waits in its group's
    barrier for trainer 1, which never comes; trainer 0 writes how long it waited and what it raised."""
    import json
    import time

    from deepspec.distributed import launch, split

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE="3")
    done = Path(out)
    with launch(10) as d:
        roles = split(d, 1, 120)
        if rank == 0:
            t = time.monotonic()
            try:
                roles.own.barrier()
                raised = None
            except Exception as e:
                raised = f"{type(e).__name__}: {e}"
            done.write_text(json.dumps({"waited_s": time.monotonic() - t, "raised": raised}))
        else:
            deadline = time.monotonic() + 90
            while not done.exists() and time.monotonic() < deadline:
                time.sleep(0.2)


def test_the_role_groups_of_a_split_world_wait_as_long_as_the_stage_says(tmp_path):
    """A group made without a timeout waits the backend's default (10 minutes under NCCL, whatever the
    stage's collective_timeout_s); `split`'s trainer and capture groups wait the launch's."""
    import json

    from deepspec.data.servers import free_port

    out = tmp_path / "waited.json"
    torch.multiprocessing.spawn(_wait_in_the_trainers_group, nprocs=3, args=(free_port(), str(out)))
    got = json.loads(out.read_text())
    assert got["raised"] is not None and 9 < got["waited_s"] < 40, got


def test_a_generator_draws_on_the_probabilities_device_and_a_foreign_one_is_refused():
    probs = torch.tensor([[0.1, 0.9], [0.8, 0.2]], device="cpu")
    got = draw(probs, generator(probs.device, 4))
    assert got.device == probs.device and torch.equal(got, torch.multinomial(probs, 1, generator=generator("cpu", 4)))

    class Foreign:  # what a CUDA generator looks like to a CPU tensor (no second device type here)
        device = torch.device("cuda", 0)

    with pytest.raises(ValueError, match="cuda generator cannot draw for cpu probabilities"):
        draw(probs, Foreign())


def test_speculative_and_plain_decoding_draw_with_generators_on_the_decoders_device(monkeypatch, trained_target):
    from transformers import AutoModelForCausalLM

    import deepspec.evaluate.specdec as specdec
    from tests.evaluate.test_specdec import random_draft

    target = AutoModelForCausalLM.from_pretrained(trained_target)
    dec = specdec.SpecDecoder(target, random_draft(target, [0, 2]), set(), device="cpu")
    made = []
    real = specdec.generator
    monkeypatch.setattr(specdec, "generator", lambda device, seed: made.append(torch.device(device)) or real(device, seed))
    warp = specdec.Warp(temperature=0.8)
    dec.plain([1, 2, 3], 4, warp, seed=1)
    dec.speculative([1, 2, 3], 4, warp, seed=1)
    assert made == [dec.device, dec.device]


def test_decoding_on_cuda_tries_cudnn_attention_after_the_kernels_with_no_per_shape_set_up():
    from torch.nn.attention import SDPBackend

    from deepspec.devices import decoding

    order = lambda: [SDPBackend(i) for i in torch._C._get_sdp_priority_order()]  # noqa: E731
    before = order()
    with decoding(torch.device("cpu")):
        assert order() == before
    with decoding(torch.device("cuda", 0)):
        inside = order()
    assert inside[:4] == [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION,
                          SDPBackend.MATH]
    assert order() == before


def test_every_decoder_decodes_inside_decoding_on_its_device(monkeypatch, trained_target):
    import contextlib

    from transformers import AutoModelForCausalLM

    import deepspec.data.generate as generate
    import deepspec.evaluate.specdec as specdec
    from deepspec.config import RegenConfig, SamplingConfig
    from deepspec.models.target import load_causal_lm
    from tests.evaluate.test_specdec import random_draft

    entered = []

    @contextlib.contextmanager
    def recording(device):
        entered.append(torch.device(device))
        yield

    monkeypatch.setattr(specdec, "decoding", recording)
    monkeypatch.setattr(generate, "decoding", recording)
    target = AutoModelForCausalLM.from_pretrained(trained_target)
    dec = specdec.SpecDecoder(target, random_draft(target, [0, 2]), set(), device="cpu")
    dec.plain([1, 2, 3], 4, specdec.Warp())
    dec.speculative([1, 2, 3], 4, specdec.Warp())
    local = generate.LocalGenerator(trained_target, RegenConfig(), SamplingConfig(max_tokens=4),
                                    lambda d: load_causal_lm(trained_target, d), device=torch.device("cpu"))
    local.answer([[1, 2, 3]], [0])
    assert entered == [torch.device("cpu")] * 3


def test_regen_row_sampler_makes_its_generators_on_the_scores_device(monkeypatch):
    import deepspec.data.generate as generate
    from deepspec.config import SamplingConfig

    made = []
    real = generate.generator
    monkeypatch.setattr(generate, "generator", lambda device, seed: made.append((torch.device(device), seed))
                        or real(device, seed))
    sampler = generate.RowSampler(SamplingConfig(temperature=0.7), [11, 12])
    scores = torch.randn(2, 50, device="cpu")
    sampler(None, scores)
    sampler(None, scores)  # made once, then advanced
    assert made == [(scores.device, 11), (scores.device, 12)]


def test_regen_local_backend_runs_the_target_on_the_accelerator_when_one_is_present(monkeypatch, trained_target):
    """`regen.backend: local` loaded the target in float32 on the CPU on a GPU node too."""
    from deepspec.config import RegenConfig, SamplingConfig
    from deepspec.data.generate import LocalGenerator

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    asked = []

    class Loaded(Exception):
        pass

    def load(device):
        asked.append(device)
        raise Loaded  # no GPU here to load it onto

    with pytest.raises(Loaded):
        LocalGenerator(trained_target, RegenConfig(), SamplingConfig(), load)
    assert asked == [torch.device("cuda", 0)]


def test_the_regen_journal_is_keyed_by_how_the_local_backend_computes():
    from deepspec.config import RegenConfig, SamplingConfig
    from deepspec.data.regen import regen_fingerprint

    cfg, s = RegenConfig(backend="local"), SamplingConfig()
    cpu = regen_fingerprint(cfg, s, None, {"dtype": "float32"})
    gpu = regen_fingerprint(cfg, s, None, {"dtype": "bfloat16"})
    assert cpu != gpu  # a journal from the CPU is not resumed into a GPU run (other floats, other answers)


def test_host_copies_are_waited_for_on_the_writer_thread_not_the_computing_one():
    """The cache stage hands the writer each batch as soon as its copies are issued; the writer's
    thread waits for them (on CUDA: an event on the copy stream), so the next forward starts at once."""
    from deepspec.cache.write.part_data import PartFeed

    x = torch.arange(12, dtype=torch.float32, device="cpu").view(3, 4)
    batch = HostCopies("cpu").copy({0: (x.to(torch.bfloat16).view(torch.uint16), None)})
    waited_on = []

    class Watched:
        def result(self):
            waited_on.append(threading.get_ident())
            return batch.result()

    feed = PartFeed(lambda: None, [0])
    got = []
    reader = threading.Thread(target=lambda: got.extend(feed.arrays()))
    reader.start()
    feed.put(Watched())
    feed.close()
    reader.join(10)
    assert waited_on == [reader.ident] and waited_on[0] != threading.get_ident()
    assert np.array_equal(got[0]["hidden/0"], x.to(torch.bfloat16).view(torch.uint16).numpy())


def test_landed_waits_for_a_batch_only_once_later_ones_are_queued():
    """Without a writer (compute_part collecting a part, gpu_check's capture) a batch's copies are
    waited for two batches later, so they land while the next forward passes run, in order."""
    from deepspec.devices import landed

    log = []

    class Batch:
        def __init__(self, i):
            self.i = i

        def result(self):
            log.append(f"wait {self.i}")
            return self.i

    def computed():
        for i in range(4):
            log.append(f"compute {i}")
            yield Batch(i)

    assert list(landed(computed())) == [0, 1, 2, 3]
    assert log == ["compute 0", "compute 1", "compute 2", "wait 0", "compute 3", "wait 1", "wait 2", "wait 3"]


def test_a_batchs_copies_are_waited_for_on_its_own_gpu_whichever_thread_waits(monkeypatch):
    """A thread's current CUDA device is its own (cuda:0 in a new one): the writer's thread waits for
    a batch's copies inside the guard of the batch's device, so a rank on cuda:3 opens no context on
    cuda:0."""
    from deepspec.devices import HostBatch

    current, waited = [], []

    class Guard:
        def __init__(self, device):
            self.device = device

        def __enter__(self):
            current.append(self.device)

        def __exit__(self, *exc):
            current.pop()

    class Event:
        def synchronize(self):
            waited.append(current[-1] if current else "no device set")

    monkeypatch.setattr(torch.cuda, "device", Guard)
    batch = HostBatch({0: (torch.zeros(2, device="cpu"), None)}, Event(), torch.device("cuda", 3))
    t = threading.Thread(target=batch.result)
    t.start()
    t.join(10)
    assert waited == [torch.device("cuda", 3)] and current == []


def test_s3_options_leave_the_processes_aws_settings_alone(monkeypatch):
    """Setting AWS_EC2_METADATA_DISABLED for the whole process switched off the instance-profile
    credentials a GPU node on EC2 uses."""
    from deepspec.cache.storage.urls import storage_options_for

    monkeypatch.delenv("AWS_EC2_METADATA_DISABLED", raising=False)
    before = dict(os.environ)
    storage_options_for("s3://bucket/lake", {})
    assert dict(os.environ) == before
