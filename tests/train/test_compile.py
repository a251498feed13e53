"""train.compile: a compiled draft step against the eager one."""
import json

import torch
from safetensors.torch import load_file
from torch._dynamo.utils import counters

from deepspec.train.checkpoint import list_checkpoints
from deepspec.train.compiled import compiles
from tests.train.test_train import losses, train

# A compiled step fuses and reorders float32 work (a softmax's sums, a norm's reduction, a matmul's
# epilogue), so each step's values differ from eager ones by float32 rounding (~1e-7 relative), and AdamW
# carries those differences on. Measured here over these 8 steps: at most ~4e-7 relative on the loss.
# 1e-5 leaves room for another CPU's kernels and fails on anything a wrong graph would give (a dropped
# term or mask moves the loss by 1e-2 or more).
LOSS_RTOL = 1e-5


def test_a_compiled_run_follows_the_eager_one_within_float32_rounding_with_a_bounded_number_of_graphs(
        tmp_path, small_cache, trained_target):
    kw = dict(steps=8, grad_accum=2, checkpoint_every=8)  # 16 micro-batches: the epoch's batch of one row too
    train(tmp_path / "eager", small_cache, trained_target, compile=False, **kw)
    graphs = counters["stats"]["unique_graphs"]
    train(tmp_path / "compiled", small_cache, trained_target, compile=True, **kw)
    # one graph of dynamic shapes for every batch length, one more for the batch of one row
    assert 1 <= counters["stats"]["unique_graphs"] - graphs <= 2
    eager, compiled = losses(tmp_path / "eager"), losses(tmp_path / "compiled")
    assert len(eager) == len(compiled) == 8
    assert all(abs(a - b) <= LOSS_RTOL * abs(a) for a, b in zip(eager, compiled)), (eager, compiled)
    assert eager != compiled  # it did run compiled code (bit-identical curves would mean it did not)
    a = load_file(tmp_path / "eager" / "draft" / "model.safetensors")
    b = load_file(tmp_path / "compiled" / "draft" / "model.safetensors")
    assert a.keys() == b.keys()  # compiled in place: the saved draft's names are the model's own
    assert all(torch.allclose(a[k], b[k], rtol=1e-4, atol=1e-6) for k in a)

    # the setting counts in what a resume compares only when it compiles (it changes the bits); an eager
    # run's fingerprint is the one it had before the setting existed, `auto` resolves by device
    def fingerprint(run):
        return json.loads((list_checkpoints(tmp_path / run / "state")[-1] / "meta.json").read_text())["fingerprint"]

    train(tmp_path / "auto", small_cache, trained_target, compile="auto", **kw)
    assert fingerprint("auto") == fingerprint("eager") != fingerprint("compiled")
    assert compiles("auto", torch.device("cpu")) is False and compiles("auto", torch.device("cuda")) is True
