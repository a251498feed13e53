"""The tiny target's Muon: torch.optim.Muon's update, orthogonalised in a dtype the CPU runs fast."""
import torch

from deepspec.embedded.muon import Muon


def _run(opt_cls, steps=4, **kw):
    torch.manual_seed(0)
    weights = [torch.nn.Parameter(torch.randn(24, 8)), torch.nn.Parameter(torch.randn(8, 16))]
    opt = opt_cls(weights, lr=0.02, weight_decay=0.1, **kw)
    for s in range(steps):
        opt.zero_grad()
        loss = sum(((w - s) ** 3).sum() for w in weights)
        loss.backward()
        opt.step()
    return [w.detach().clone() for w in weights]


def test_same_update_as_torch_muon_in_bfloat16():
    ours, theirs = _run(Muon, dtype=torch.bfloat16), _run(torch.optim.Muon)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_float32_orthogonalisation_differs_only_by_rounding():
    ours, theirs = _run(Muon, dtype=torch.float32), _run(torch.optim.Muon)
    for a, b in zip(ours, theirs):
        assert not torch.equal(a, b)
        torch.testing.assert_close(a, b, rtol=0, atol=2e-2)
