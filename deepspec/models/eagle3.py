"""EAGLE-3 draft: a chain drafter on fused target features, trained from the same cache as DSpark/DFlash.

The public definitions this follows (speculators' `Eagle3DraftModel` with a Llama first layer, sglang's
`LlamaForCausalLMEagle3`, both after EAGLE's cnets.py):
  - `fc` fuses the target's features at exactly three layers (concatenated, 3 x H_target -> H);
  - one Llama-shaped decoder layer reads [input_layernorm(embed(token)) ; hidden_norm(hidden)]: q/k/v
    take 2H, no q/k norm; the residual is the un-normalised hidden;
  - `norm` + `lm_head` give logits over a reduced draft vocabulary of `draft_vocab_size` tokens:
    `d2t[i]` is the offset of draft token i (target id = i + d2t[i]), `t2d` marks the target tokens
    kept, both built from the cache's loss-token frequencies (the most frequent, ids ascending).
Positions: the pair (token x_{t+1}, feature g_t of token t) sits at position t+1 and predicts x_{t+2}.
Chain step k (k >= 1) of that row reads the token of step k-1 and the layer output of step k-1,
sits at position t+1+k and attends to the step-0 keys of positions <= t+1 and to its own row's
earlier chain keys (the "training-time test": training unrolls `ttt_steps` such steps with the data's
tokens as inputs; decoding runs them with the draft's own tokens).

The target's full lm_head is kept as a non-persistent buffer for the loss (p_target over the whole
vocabulary); it is not saved: engines never need it, and a draft in use takes only its own head.
"""
from __future__ import annotations

from collections import Counter

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import (LlamaMLP, LlamaRMSNorm, LlamaRotaryEmbedding,
                                                      apply_rotary_pos_emb)

from deepspec.models.attention import attend
from deepspec.models.draft import save_draft, target_embed
from deepspec.models.objectives import LossOutput, masked_mean

EAGLE3_AUX_LAYERS = 3  # sglang fixes the fused input at 3 x target hidden


def llama_config(cfg) -> LlamaConfig:
    return LlamaConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
                       num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
                       num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, rms_norm_eps=cfg.rms_norm_eps,
                       rope_parameters=cfg.rope(), max_position_embeddings=cfg.max_position_embeddings,
                       attention_bias=False, mlp_bias=False, hidden_act="silu")


def vocab_map(counts: Counter | dict, draft_vocab_size: int, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t, t2d): the `draft_vocab_size` most frequent tokens (ties by id; topped up with the lowest
    unused ids when fewer tokens occur), ids ascending; d2t holds offsets, t2d a bool mask over the target
    vocabulary (the layout speculators, vLLM and sglang read)."""
    if not 0 < draft_vocab_size <= vocab_size:
        raise ValueError(f"draft_vocab_size {draft_vocab_size} must be in [1, {vocab_size}] (the target's vocabulary)")
    ranked = sorted((t for t in counts if 0 <= t < vocab_size), key=lambda t: (-counts[t], t))[:draft_vocab_size]
    chosen = set(ranked)
    for t in range(vocab_size):
        if len(chosen) >= draft_vocab_size:
            break
        chosen.add(t)
    ids = torch.tensor(sorted(chosen), dtype=torch.long, device="cpu")  # maps a model takes with set_vocab
    t2d = torch.zeros(vocab_size, dtype=torch.bool, device="cpu")
    t2d[ids] = True
    return ids - torch.arange(draft_vocab_size, device="cpu"), t2d


def samples_of(dataset):
    """The items of a map-style dataset in index order, or those of an iterable as it yields them."""
    return (dataset[i] for i in range(len(dataset))) if hasattr(dataset, "__len__") else iter(dataset)


def loss_token_counts(dataset) -> Counter:
    """Frequencies of the tokens the loss sees (loss_mask 1) over a TargetCacheDataset of ids + masks
    (or any iterable of such samples)."""
    counts: Counter = Counter()
    for item in samples_of(dataset):
        ids = item["input_ids"].numpy()[item["loss_mask"].numpy().astype(bool)]
        values, n = np.unique(ids, return_counts=True)
        counts.update(dict(zip(values.tolist(), n.tolist())))
    return counts


class Eagle3Layer(nn.Module):
    """Llama decoder layer whose attention reads [embeddings ; hidden] (2H). Names as in speculators/sglang."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        H, hd = config.hidden_size, config.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, hd
        self.self_attn = nn.Module()
        self.self_attn.q_proj = nn.Linear(2 * H, self.num_heads * hd, bias=False)
        self.self_attn.k_proj = nn.Linear(2 * H, self.num_kv_heads * hd, bias=False)
        self.self_attn.v_proj = nn.Linear(2 * H, self.num_kv_heads * hd, bias=False)
        self.self_attn.o_proj = nn.Linear(self.num_heads * hd, H, bias=False)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = LlamaRMSNorm(H, eps=config.rms_norm_eps)
        self.hidden_norm = LlamaRMSNorm(H, eps=config.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(H, eps=config.rms_norm_eps)

    def forward(self, emb: torch.Tensor, hidden: torch.Tensor, rope, mask: torch.Tensor | None,
                past: list[tuple[torch.Tensor, torch.Tensor]] = ()):
        """emb, hidden: [B, Q, H]; past: earlier (k, v) blocks this step attends to (mask columns in
        that order, then its own). Returns (output [B, Q, H], its own (k, v))."""
        q, k, v = self.attention_inputs(emb, hidden, *rope)
        keys = torch.cat([*(p[0] for p in past), k], dim=2)
        values = torch.cat([*(p[1] for p in past), v], dim=2)
        out = attend(q, keys, values, mask, self.head_dim ** -0.5, self.num_heads != self.num_kv_heads)
        return self.attention_output(hidden, out), (k, v)

    # the two halves around the attention (train.compile compiles each: neither depends on how many
    # earlier blocks the step attends to)
    def attention_inputs(self, emb: torch.Tensor, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        a = self.self_attn
        x = torch.cat([self.input_layernorm(emb), self.hidden_norm(hidden)], dim=-1)
        shape = (*x.shape[:-1], -1, self.head_dim)
        q = a.q_proj(x).view(shape).transpose(1, 2)
        k = a.k_proj(x).view(shape).transpose(1, 2)
        v = a.v_proj(x).view(shape).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        return q, k, v

    def attention_output(self, hidden: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        h = hidden + self.self_attn.o_proj(out.transpose(1, 2).reshape(*hidden.shape[:-1], -1))
        return h + self.mlp(self.post_attention_layernorm(h))


class Eagle3Model(nn.Module):
    FROZEN = ("embed_tokens.weight",)

    def __init__(self, config):
        super().__init__()
        if len(config.target_layers) != EAGLE3_AUX_LAYERS:
            raise ValueError(f"EAGLE-3 fuses exactly {EAGLE3_AUX_LAYERS} target layers, got {config.target_layers}")
        if config.num_layers != 1:
            raise ValueError(f"EAGLE-3 has one decoder layer (train.draft_layers: 1), got {config.num_layers}")
        self.config = config
        lc = llama_config(config)
        H, V, Vd = config.hidden_size, config.vocab_size, config.draft_vocab_size
        self.embed_tokens = nn.Embedding(V, H)
        self.fc = nn.Linear(config.target_hidden_size * EAGLE3_AUX_LAYERS, H, bias=False)
        self.layers = nn.ModuleList([Eagle3Layer(lc)])
        self.norm = LlamaRMSNorm(H, eps=config.rms_norm_eps)
        self.lm_head = nn.Linear(H, Vd, bias=False)
        self.rotary = LlamaRotaryEmbedding(lc)
        # buffers move with the model (`.to(device)`), like its parameters
        self.register_buffer("d2t", torch.zeros(Vd, dtype=torch.long, device="cpu"))
        self.register_buffer("t2d", torch.zeros(V, dtype=torch.bool, device="cpu"))
        self.register_buffer("verifier_head", torch.zeros(0, H, device="cpu"), persistent=False)
        for name, p in self.named_parameters():
            if name not in self.FROZEN and p.ndim >= 2:
                nn.init.normal_(p, std=0.02)

    # ---- set-up --------------------------------------------------------------------------------
    def set_vocab(self, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
        with torch.no_grad():
            self.d2t.copy_(d2t)
            self.t2d.copy_(t2d)

    def copy_target_embeddings(self, target) -> None:
        self.set_target_embeddings(target.get_input_embeddings().weight, target.get_output_embeddings().weight)

    def set_target_embeddings(self, embed: torch.Tensor, head: torch.Tensor) -> None:
        """The target's embeddings (frozen), its lm_head rows of the draft vocabulary as the draft head's
        start (trained), and its full head for the loss."""
        with torch.no_grad():
            self.embed_tokens.weight.copy_(embed)
            head = head.detach().clone()
            self.lm_head.weight.copy_(head[self.draft_ids()])
            self.verifier_head = head.to(self.fc.weight.device)
        self.freeze_embeddings()

    def freeze_embeddings(self) -> None:
        self.embed_tokens.weight.requires_grad_(False)

    def draft_ids(self) -> torch.Tensor:
        """[Vd] target id of each draft token."""
        return torch.arange(self.d2t.shape[0], device=self.d2t.device) + self.d2t

    def target_to_draft(self) -> torch.Tensor:
        """[V] draft index of each target token, -1 outside the draft vocabulary."""
        idx = torch.cumsum(self.t2d.long(), 0) - 1
        return torch.where(self.t2d, idx, torch.full_like(idx, -1))

    # ---- forward pieces ------------------------------------------------------------------------
    @property
    def layer(self) -> Eagle3Layer:
        return self.layers[0]

    def step(self, tokens: torch.Tensor, hidden: torch.Tensor, pos: torch.Tensor, mask, past=()):
        """One pass of the decoder layer: tokens/pos [B, Q], hidden [B, Q, H] -> (output, (k, v))."""
        emb = target_embed(self.embed_tokens, tokens, self.config.embed_scale).to(hidden.dtype)
        return self.layer(emb, hidden, self.rotary(hidden, pos), mask, past)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """[.., H] layer outputs -> [.., Vd] draft-vocabulary logits (fp32)."""
        return self.lm_head(self.norm(h)).float()

    def forward(self, batch: dict, anchors, ce_w: float, l1_w: float, conf_w: float, decay_gamma: float,
                norm: float | None = None):
        """Training forward (the loss); `anchors` are unused: every position drafts."""
        return eagle3_loss(self, batch, ce_w, l1_w, decay_gamma, norm)

    def save(self, out_dir) -> None:
        save_draft(self, out_dir)


# ---- training: the training-time test unrolled over ttt_steps ---------------------------------------

def _eagle3_valid(batch: dict, steps: int) -> torch.Tensor:
    """[B, T-1, K]: row t, step k predicts token t+2+k; it counts while every label up to it is a loss
    token inside the sample (the cumulative mask DSpark's drafts use too)."""
    ids, loss_mask = batch["input_ids"], batch["loss_mask"].bool()
    lengths = batch["lengths"].to(ids.device)
    B, T = ids.shape
    label = torch.arange(T - 1, device=ids.device)[:, None] + 2 + torch.arange(steps, device=ids.device)  # [T-1, K]
    inside = label[None] < lengths[:, None, None]
    sup = torch.gather(loss_mask, 1, label.clamp(max=T - 1).reshape(1, -1).expand(B, -1)).view(B, T - 1, steps)
    return torch.cumprod((inside & sup).int(), dim=2).bool()


def eagle3_weights(batch: dict, steps: int, decay_gamma: float) -> torch.Tensor:
    valid = _eagle3_valid(batch, steps)
    k = torch.arange(steps, device=valid.device)
    return valid.float() * torch.exp(-k.float() / decay_gamma)


# supervised rows whose target ([rows, V] fp32: 0.6 GB at V = 151,936) and draft distributions exist
# at once; all the rows of a batch (8 x 4,096) at once would be 20 GB per chain step
TARGET_CHUNK_ROWS = 1024


@torch.no_grad()
def target_on_draft_vocab(last_hidden: torch.Tensor, head: torch.Tensor, draft_ids: torch.Tensor,
                          chunk_rows: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's distribution restricted to the draft vocabulary ([M, Vd] fp32; the mass outside is
    1 - its row sum) and the target's argmax ([M]), computed `chunk_rows` rows at a time so that the
    full-vocabulary distribution of only one chunk exists at any moment."""
    chunk_rows = chunk_rows or TARGET_CHUNK_ROWS
    p_draft, top = [], []
    for a in range(0, last_hidden.shape[0], chunk_rows):
        p = F.linear(last_hidden[a:a + chunk_rows], head).float().softmax(-1)
        p_draft.append(p[:, draft_ids])
        top.append(p.argmax(-1))
        del p
    if not p_draft:
        return last_hidden.new_zeros((0, len(draft_ids)), dtype=torch.float32), \
            torch.zeros(0, dtype=torch.long, device=last_hidden.device)
    return torch.cat(p_draft), torch.cat(top)


def keeps_target_terms(draft_vocab: int, intermediate: int) -> bool:
    """Whether a chunk's target distribution on the draft vocabulary ([rows, Vd] fp32) is computed once
    and kept for backward, instead of the [rows, V] product with the target's head (the loss's largest)
    being computed again in backward: kept while it adds at most a quarter to what the decoder layer
    keeps per row anyway (its MLP's three [rows, I] activations, bf16 under autocast). Qwen3-4B's
    width with the default 2,048-token draft vocabulary keeps it; a 32,000-token one recomputes."""
    return 4 * draft_vocab <= (3 * intermediate * 2) // 4


def _chunk_terms(model: Eagle3Model, h: torch.Tensor, labels: torch.Tensor, wk: torch.Tensor,
                 draft_ids: torch.Tensor, target_h: torch.Tensor | None, p_t_draft: torch.Tensor | None,
                 target_top: torch.Tensor | None):
    """The weighted CE and L1 sums of some supervised rows, and (no grad) each row's L1 and whether
    the draft's argmax is the target's. The target's side: `p_t_draft` and `target_top` as computed,
    or computed here from `target_h`."""
    logits = model.logits(h)                                                          # [rows, Vd]
    if p_t_draft is None:
        p_t_draft, target_top = target_on_draft_vocab(target_h, model.verifier_head, draft_ids,
                                                      chunk_rows=len(target_h) or 1)
    p_draft = logits.softmax(-1)
    l1 = (p_draft - p_t_draft).abs().sum(-1) + (1 - p_t_draft.sum(-1)).clamp_min(0)
    ce = F.cross_entropy(logits, labels.clamp_min(0), reduction="none") * (labels >= 0)
    agree = draft_ids[logits.argmax(-1)] == target_top
    return (ce * wk).sum(), (l1 * wk).sum(), l1.detach(), agree


def eagle3_loss(model: Eagle3Model, batch: dict, ce_w: float, l1_w: float, decay_gamma: float,
                norm: float | None = None):
    """The DSpark loss terms per (row, step): ce_w * CE(data token) + l1_w * |p_draft - p_target|_1, with
    p_draft over the draft vocabulary placed in the target's (zero elsewhere; a data token outside the
    draft vocabulary has no CE term), so alpha = 1 - L1/2 is the sampled acceptance probability."""
    K = model.config.ttt_steps
    ids = batch["input_ids"]
    B, T = ids.shape
    n = T - 1
    dtype = model.fc.weight.dtype
    valid = _eagle3_valid(batch, K)                                                  # [B, n, K]
    w = valid.float() * torch.exp(-torch.arange(K, device=ids.device).float() / decay_gamma)
    total = (w.sum() if norm is None else torch.as_tensor(norm, device=w.device)).clamp_min(1e-6)
    causal = torch.ones(n, n, dtype=torch.bool, device=ids.device).tril()
    diag = torch.eye(n, dtype=torch.bool, device=ids.device)
    pos = torch.arange(1, T, device=ids.device)[None].expand(B, n)
    h = model.fc(batch["hidden"][:, :n].to(dtype))
    t2d_index, draft_ids = model.target_to_draft(), model.draft_ids()
    device_type = ids.device.type
    head_dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else dtype
    if model.verifier_head.dtype != head_dtype:
        # once, not per chunk: the head's product runs in this dtype anyway (autocast's bf16 on a GPU),
        # and autocast casts a buffer again at every use, moving the whole [V, H] head through memory
        model.verifier_head = model.verifier_head.to(head_dtype)
    keep = keeps_target_terms(len(draft_ids), model.config.intermediate_size)
    past, loss = [], torch.zeros((), device=ids.device)
    ce_sum = l1_sum = torch.zeros((), dtype=torch.float64, device=ids.device)
    agree = torch.zeros(B, n, K, dtype=torch.bool, device=ids.device)
    alpha_full = torch.zeros(B, n, K, device=ids.device)
    for k in range(K):
        tokens = F.pad(ids[:, 1 + k:], (0, k))                                       # x_{t+1+k}, data tokens
        mask = torch.cat([causal] + [diag] * k, dim=1)
        h, kv = model.step(tokens, h, pos + k, mask, past)
        past.append(kv)
        # the step's supervised rows, found once (its one read-back: the count decides the chunks); every
        # selection below gathers by them
        b_idx, t_idx = valid[:, :, k].nonzero(as_tuple=True)
        if len(b_idx) == 0:
            continue
        labels = t2d_index[ids[b_idx, t_idx + 2 + k]]                                # draft index, -1 outside
        target_h = batch["last_hidden"][b_idx, t_idx + 1 + k].to(head_dtype)
        wk = w[b_idx, t_idx, k]
        head_rows, l1_all, agree_all = h[b_idx, t_idx], [], []
        for a in range(0, len(labels), TARGET_CHUNK_ROWS):
            # a chunk's [rows, V] target and [rows, Vd] draft distributions exist only while it is
            # computed; backward recomputes the draft's (checkpoint), and the target's unless kept
            c = slice(a, a + TARGET_CHUNK_ROWS)
            target = (target_h[c], None, None) if not keep else \
                (None, *target_on_draft_vocab(target_h[c], model.verifier_head, draft_ids, len(target_h[c]) or 1))
            ce_c, l1_c, l1_rows, agree_rows = checkpoint(
                _chunk_terms, model, head_rows[c], labels[c], wk[c], draft_ids, *target, use_reentrant=False)
            loss = loss + (ce_w * ce_c + l1_w * l1_c) / total
            ce_sum = ce_sum + ce_c.detach().double()
            l1_sum = l1_sum + l1_c.detach().double()
            l1_all.append(l1_rows)
            agree_all.append(agree_rows)
        with torch.no_grad():
            agree[b_idx, t_idx, k] = torch.cat(agree_all)
            alpha_full[b_idx, t_idx, k] = (1 - 0.5 * torch.cat(l1_all)).clamp(0, 1)
    if not loss.requires_grad and torch.is_grad_enabled():
        # no row of this micro-batch is supervised: a zero loss that still reaches every trainable
        # parameter, so its backward (and DDP's reduction with the other ranks) runs as for any batch
        loss = loss + model.logits(h[:0]).sum()
    with torch.no_grad():  # tensors on the device: the trainer reads them back once per optimizer step
        metrics = {"ce": ce_sum / total.double(), "l1": l1_sum / total.double(), "supervised_slots": valid.sum(),
                   "weight": w.sum(), "loss": loss.detach()}
        rows = valid[:, :, 0]
        metrics["tau_prob"] = 1 + masked_mean(torch.cumprod(alpha_full, 2).sum(-1), rows)
        metrics["tau_greedy"] = 1 + masked_mean(torch.cumprod(agree.float(), 2).sum(-1), rows)
        acc = (agree & valid).sum((0, 1)).float() / valid.sum((0, 1))  # exact sums of 0/1, as one step at a time
        metrics.update({f"acc@{k}": acc[k] for k in range(K)})
    return LossOutput(loss, metrics)
