"""The draft's training objective on one batch of cached target states (reference definitions).

Anchors: up to `num_anchors` positions per sample with loss on the anchor and on its next token,
drawn uniformly without replacement from a generator the caller seeds (so a resumed run draws the
same anchors). Draft j of the block at anchor a predicts token a+j+1 (j = 0 .. num_drafts-1); it
reads slot j + draft_offset, which is slot j itself under `sample_from_anchor` and slot j+1 in the
dflash layout (slot 0's output unused): the loss follows the draft's convention. A draft counts
only while all earlier drafts' labels are supervised (the reference's cumulative "eval mask").
Draft weights decay as exp(-j / decay_gamma).

    loss = ce_w * CE(draft, data token) + l1_w * |p_draft - p_target|_1 + conf_w * BCE(conf, alpha)

with p_target = softmax(lm_head(last_hidden[a+j])) (the frozen head over the cached post-norm
state, computed only at the supervised drafts) and alpha = 1 - L1/2 = sum(min(p_draft, p_target)),
the probability that draft j is accepted.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F


@dataclass
class Anchors:
    pos: torch.Tensor        # [B, N] anchor positions (0 where unused)
    keep: torch.Tensor       # [B, N] bool: a real anchor


ANCHOR_BOUNDS = {"seed": 2**64, "step": 2**38, "micro-batch": 1024, "rank": 2**16}


def anchor_key(seed: int, step: int, micro: int, rank: int) -> tuple[int, int]:
    """The 128-bit Philox key of the anchor draw of micro-batch `micro` of optimizer step `step` on
    `rank`: (seed, step * 2^26 + micro * 2^16 + rank). Within ANCHOR_BOUNDS (grad_accum up to 1024,
    up to 65,536 ranks, 2^38 steps) distinct tuples are distinct keys, i.e. distinct streams, by
    construction. (torch's CPU generator would not do: it keeps only 32 bits of its seed.)"""
    for name, value in (("seed", seed), ("step", step), ("micro-batch", micro), ("rank", rank)):
        if not 0 <= value < ANCHOR_BOUNDS[name]:
            raise ValueError(f"anchor seed: {name} {value} outside [0, {ANCHOR_BOUNDS[name]})")
    return seed, (step << 26) | (micro << 16) | rank


def anchor_generator(seed: int, step: int, micro: int, rank: int) -> np.random.Generator:
    return np.random.Generator(np.random.Philox(key=np.array(anchor_key(seed, step, micro, rank), dtype=np.uint64)))


def sample_anchors(loss_mask: torch.Tensor, lengths: torch.Tensor, num: int,
                   generator: np.random.Generator | torch.Generator) -> Anchors:
    B, T = loss_mask.shape
    lm = loss_mask.bool()
    ok = torch.zeros_like(lm)
    ok[:, :-1] = lm[:, :-1] & lm[:, 1:]
    ok &= torch.arange(T, device=lm.device)[None, :] < (lengths[:, None] - 1)
    if isinstance(generator, np.random.Generator):
        noise = torch.from_numpy(generator.random((B, T), dtype=np.float32))
        # from pageable memory a copy to the GPU waits for the work queued before it (the previous
        # micro-batch's backward); from pinned memory it is queued behind it
        noise = noise.pin_memory().to(lm.device, non_blocking=True) if lm.device.type == "cuda" else noise.to(lm.device)
    else:
        noise = torch.rand((B, T), generator=generator, device=generator.device).to(lm.device)
    noise = torch.where(ok, noise, torch.full_like(noise, 2.0))  # invalid positions sort last
    n = min(num, T)
    order = noise.argsort(dim=1)[:, :n]
    keep = torch.gather(ok, 1, order)
    pos = torch.where(keep, order, torch.zeros_like(order))
    # sort kept anchors by position (unused slots after them)
    key = torch.where(keep, pos, torch.full_like(pos, T + 1))
    idx = key.argsort(dim=1)
    return Anchors(torch.gather(pos, 1, idx), torch.gather(keep, 1, idx))


def block_mask(anchors: Anchors, lengths: torch.Tensor, T: int, block: int) -> torch.Tensor:
    """[B, 1, N*γ, T + N*γ] bool (True = may attend): context strictly before the anchor (and inside
    the sample), the whole own block in both directions."""
    B, N = anchors.pos.shape
    kv = torch.arange(T, device=anchors.pos.device)
    ctx = (kv[None, None, :] < anchors.pos[:, :, None]) & (kv[None, None, :] < lengths[:, None, None])
    ctx = ctx & anchors.keep[:, :, None]
    ctx = ctx[:, :, None, :].expand(B, N, block, T).reshape(B, N * block, T)
    blk_id = torch.arange(N * block, device=kv.device) // block
    own = (blk_id[:, None] == blk_id[None, :])[None].expand(B, -1, -1)
    return torch.cat([ctx, own], dim=2)[:, None]


@dataclass
class LossOutput:
    """`metrics`: detached 0-d tensors on the loss's device, read back by the trainer once per optimizer
    step (never per micro-batch). A rate over an empty set (no supervised block, no slot j) is NaN."""
    loss: torch.Tensor
    metrics: dict


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of `values` where `mask`; NaN where the mask is empty (no host read to ask first)."""
    return torch.where(mask, values, torch.zeros_like(values)).sum() / mask.sum()


def _labels(batch: dict, anchors: Anchors, block: int):
    """label positions [B, N, D] for D = `block` drafts, and the cumulative "every draft so far is
    supervised" mask."""
    ids, loss_mask = batch["input_ids"], batch["loss_mask"]
    lengths = batch["lengths"].to(ids.device)
    B, T = ids.shape
    N = anchors.pos.shape[1]
    k = torch.arange(block, device=ids.device)
    label_pos = anchors.pos[:, :, None] + k + 1
    safe = label_pos.clamp(max=T - 1)
    supervised = (label_pos < lengths[:, None, None]) & torch.gather(
        loss_mask.bool()[:, None, :].expand(B, N, T), 2, safe)
    valid = torch.cumprod((supervised & anchors.keep[:, :, None]).int(), dim=2).bool()
    return label_pos, valid


def draft_loss(model, batch: dict, anchors: Anchors, ce_w: float, l1_w: float, conf_w: float,
               decay_gamma: float, norm: float | None = None) -> LossOutput:
    """`norm` replaces the batch's own sum of slot weights as the normaliser (the trainer passes the
    global batch's sum, so micro-batches and ranks add up to one big batch)."""
    cfg = model.config
    g = cfg.block_size
    d = cfg.num_drafts
    ids, lengths = batch["input_ids"], batch["lengths"].to(batch["input_ids"].device)
    B, T = ids.shape
    dtype = model.fc.weight.dtype
    N = anchors.pos.shape[1]
    ctx = model.context(batch["hidden"].to(dtype))
    ctx_pos = torch.arange(T, device=ids.device)[None].expand(B, T)
    mask = block_mask(anchors, lengths, T, g)
    anchor_tok = torch.gather(ids, 1, anchors.pos)
    h = model.drafts(model.block_states(anchor_tok, anchors.pos, ctx, ctx_pos, mask))  # [B, N, D, H]

    k = torch.arange(d, device=ids.device)
    label_pos, valid = _labels(batch, anchors, d)                                 # [B, N, D]
    labels = torch.gather(ids[:, None, :].expand(B, N, T), 2, label_pos.clamp(max=T - 1))
    prev = torch.gather(ids[:, None, :].expand(B, N, T), 2, (label_pos - 1).clamp(max=T - 1))
    w = valid.float() * torch.exp(-k.float() / decay_gamma)[None, None, :]
    total = w.sum() if norm is None else torch.as_tensor(norm, device=w.device)
    total = total.clamp_min(1e-6)

    # the supervised slots as flat indices, found once: the one read-back of a micro-batch (their count
    # decides the shapes that follow); each selection below is a gather by them, no further read
    flat = valid.flatten().nonzero().squeeze(1)                                     # [M]
    h_sel = h.reshape(B * N * d, -1)[flat]
    prev_sel, lab_sel, w_sel = prev.flatten()[flat], labels.flatten()[flat], w.flatten()[flat]
    draft_logits = model.logits(h_sel, prev_sel)                                    # [M, V] fp32
    tgt_pos = (label_pos - 1).flatten()[flat]                                       # a + j
    b_idx = flat // (N * d)
    with torch.no_grad():
        target_logits = model.lm_head(batch["last_hidden"][b_idx, tgt_pos].to(dtype)).float()
        p_target = target_logits.softmax(-1)
    p_draft = draft_logits.softmax(-1)
    ce = F.cross_entropy(draft_logits, lab_sel, reduction="none")
    l1 = (p_draft - p_target).abs().sum(-1)
    alpha = (1 - 0.5 * l1).clamp(0, 1).detach()
    loss = (ce_w * (ce * w_sel).sum() + l1_w * (l1 * w_sel).sum()) / total
    with torch.no_grad():
        denom = total.double()
        metrics = {"ce": (ce * w_sel).sum().double() / denom, "l1": (l1 * w_sel).sum().double() / denom,
                   "supervised_slots": valid.sum(), "weight": w.sum()}
    conf = model.confidence(h_sel, prev_sel)
    if conf is not None:
        bce = F.binary_cross_entropy_with_logits(conf, alpha, reduction="none")
        loss = loss + conf_w * (bce * w_sel).sum() / total
        metrics["conf"] = (bce.detach() * w_sel).sum().double() / denom
    with torch.no_grad():
        # acceptance estimates per slot: alpha (probabilistic), argmax agreement (greedy)
        full_alpha = torch.zeros(B * N * d, device=ids.device).index_put_((flat,), alpha).view(B, N, d)
        agree = torch.zeros(B * N * d, dtype=torch.bool, device=ids.device).index_put_(
            (flat,), draft_logits.argmax(-1) == target_logits.argmax(-1)).view(B, N, d)
        blocks = valid[:, :, 0]
        metrics["tau_prob"] = 1 + masked_mean(torch.cumprod(full_alpha, dim=2).sum(-1), blocks)
        metrics["tau_greedy"] = 1 + masked_mean(torch.cumprod(agree.float(), dim=2).sum(-1), blocks)
        # every slot's rate at once (sums of 0/1 are exact: the same values as one slot at a time)
        acc = (agree & valid).sum((0, 1)).float() / valid.sum((0, 1))
        metrics.update({f"acc@{j}": acc[j] for j in range(d)})
        metrics["loss"] = loss.detach()
    return LossOutput(loss, metrics)
