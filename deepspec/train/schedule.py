"""Learning-rate schedules as pure functions of the optimizer step (nothing to save but the step)."""
from __future__ import annotations

import math

from deepspec.config import TrainConfig


def lr_factor(step: int, cfg: TrainConfig) -> float:
    """Multiplier of `cfg.lr` at optimizer step `step` (0-based): linear warmup, then
    cosine decay to `min_lr_ratio`, cosine with warm restarts (SGDR), or constant."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    t = step - cfg.warmup_steps
    floor = cfg.min_lr_ratio
    if cfg.schedule == "constant":
        return 1.0
    if cfg.schedule == "cosine":
        p = min(1.0, t / max(1, cfg.steps - cfg.warmup_steps))
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * p))
    # SGDR: periods T0, T0*m, T0*m^2, ...; each restarts at the full rate
    period = cfg.sgdr_period
    while t >= period:
        t -= period
        period = max(1, int(round(period * cfg.sgdr_mult)))
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * t / period))
