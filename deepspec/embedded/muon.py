"""Muon (momentum, then Newton–Schulz orthogonalisation of the update) for the tiny target's hidden
matrices, with the orthogonalisation in a chosen dtype.

torch.optim.Muon always orthogonalises in bfloat16. On CPUs without native bf16 dot products (AVX2
only) those matmuls are emulated: measured 51 ms vs 3.5 ms per 384x128 matrix in float32, which made
the embedded target's training ~10x slower (Muon was 70% of a step). Same update rule, learning-rate
adjustment and decoupled weight decay as torch's (tests/models/test_muon.py compares them in bf16).
"""
from __future__ import annotations

import math

import torch

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # torch.optim.Muon's (Keller Jordan's quintic iteration)


def orthogonalize(update: torch.Tensor, steps: int, dtype: torch.dtype, eps: float = 1e-7) -> torch.Tensor:
    """Newton–Schulz on a stack of same-shape matrices [n, r, c], one bmm per iteration (the tiny
    target has 36 layers of each shape, and per-matrix calls were a quarter of its step time)."""
    a, b, c = NS_COEFFICIENTS
    x = update.to(dtype)
    tall = x.size(1) > x.size(2)
    if tall:
        x = x.transpose(1, 2)
    x = x / x.norm(dim=(1, 2), keepdim=True).clamp(min=eps)
    for _ in range(steps):
        gram = x @ x.transpose(1, 2)
        x = torch.baddbmm(x, torch.baddbmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.transpose(1, 2) if tall else x


class Muon(torch.optim.Optimizer):
    def __init__(self, params, lr: float, weight_decay: float = 0.1, momentum: float = 0.95,
                 nesterov: bool = True, ns_steps: int = 5, dtype: torch.dtype = torch.float32):
        super().__init__(params, dict(lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
                                      ns_steps=ns_steps))
        self.dtype = dtype

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            lr, mom = group["lr"], group["momentum"]
            by_shape: dict[tuple[int, int], list[tuple[torch.Tensor, torch.Tensor]]] = {}
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.ndim != 2:
                    raise ValueError(f"Muon takes 2-D matrices, got a parameter of shape {tuple(p.shape)}")
                buf = self.state[p].setdefault("momentum_buffer", torch.zeros_like(p.grad))
                buf.lerp_(p.grad, 1 - mom)
                update = p.grad.lerp(buf, mom) if group["nesterov"] else buf
                by_shape.setdefault(tuple(p.shape), []).append((p, update))
            for (rows, cols), items in by_shape.items():
                ortho = orthogonalize(torch.stack([u for _, u in items]), group["ns_steps"], self.dtype)
                for (p, _), update in zip(items, ortho):
                    p.mul_(1 - lr * group["weight_decay"])
                    p.add_(update.to(p.dtype), alpha=-lr * math.sqrt(max(1.0, rows / cols)))
