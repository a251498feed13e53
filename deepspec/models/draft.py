"""DSpark / DFlash draft models: block drafting from the target's hidden states.

The draft fuses the target's features at `target_layers` (concatenated per token) through a linear
projection and an RMSNorm into one context vector per position. A block of `block_size` (γ) slots
starts at an anchor position a: slot 0 holds the anchor token, the other slots the mask embedding,
and slot k sits at position a+k. Two slot conventions (speculators' `sample_from_anchor`):
  true   slot k predicts token a+k+1: γ drafts per block (DSpark's default, the reference's);
  false  slot 0's output is unused and slot k predicts the token at its own position a+k:
         γ-1 drafts per block (the dflash package's layout, which sglang serves).
Either way draft j (0-based) predicts token a+j+1 from slot j + `draft_offset`. Each draft layer
attends, from the block, to the context keys strictly before the anchor and to its whole block (both
directions); context and block keys share the layer's projections. DSpark adds a low-rank Markov head
(a bias on the logits from the previous token) and a confidence head (predicts each draft's
acceptance probability); DFlash is the same model without both heads.

Built from transformers' Qwen3 blocks (attention projections + q/k norms, MLP, RMSNorm, RoPE);
attention runs through SDPA with an explicit boolean mask. Embeddings and lm_head are copies of
the target's and stay frozen. The mask slots are the target's embedding row of a reserved token
(`mask_token_id`, frozen), as speculators and dflash build them, so the served draft sees exactly
what it was trained on; `mask_token_id = -1` keeps a learned mask vector instead (no engine can
load that).
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import nn
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import (Qwen3Attention, Qwen3MLP, Qwen3RMSNorm,
                                                      Qwen3RotaryEmbedding, apply_rotary_pos_emb, rotate_half)

from deepspec.models.attention import attend
from deepspec.models.objectives import draft_loss

DRAFT_FORMAT_VERSION = 1


@dataclass
class DraftConfig:
    algorithm: str                  # "dspark" | "dflash" | "eagle3" (deepspec/models/eagle3.py)
    target_layers: list[int]
    target_hidden_size: int
    vocab_size: int
    block_size: int = 4
    num_layers: int = 1
    hidden_size: int = 128
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 32
    intermediate_size: int = 384
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_parameters: dict = field(default_factory=dict)  # the target's RoPE (type, scaling); {} = default at rope_theta
    max_position_embeddings: int = 32768
    embed_scale: float = 1.0        # the target's input-embedding multiplier (Gemma: sqrt(hidden_size))
    markov_rank: int = 64           # 0 disables the Markov head (dflash)
    confidence: bool = True         # False disables the confidence head (dflash)
    mask_token_id: int = -1         # reserved target token whose embedding fills the mask slots; -1 = learned
    mask_token: str = ""            # that token's text (what engines that look it up by name need)
    sample_from_anchor: bool = True # see the module doc: slot k predicts a+k+1 (true) or a+k (false)
    ttt_steps: int = 0              # eagle3: chain steps trained and drafted per round (= block_size)
    draft_vocab_size: int = 0       # eagle3: size of the reduced draft vocabulary (d2t/t2d); 0 = none
    target: dict = field(default_factory=dict)  # identity of the target the draft was trained on
    format_version: int = DRAFT_FORMAT_VERSION

    @property
    def draft_offset(self) -> int:
        """The slot that holds draft 0: 0 when the anchor slot drafts, 1 when its output is unused."""
        return 0 if self.sample_from_anchor else 1

    @property
    def num_drafts(self) -> int:
        """Draft tokens one block proposes."""
        return self.block_size - self.draft_offset

    @classmethod
    def for_target(cls, algorithm: str, target_config, target_layers: list[int], block_size: int,
                   num_layers: int, markov_rank: int, identity: dict, mask_token_id: int = -1,
                   mask_token: str = "", sample_from_anchor: bool = True, ttt_steps: int = 0,
                   draft_vocab_size: int = 0, embed_scale: float = 1.0) -> "DraftConfig":
        """Draft layers take the target's own dimensions and RoPE (as the reference does). EAGLE-3
        drafts a chain of `ttt_steps` tokens per round (its block_size) and has no mask slots.
        `embed_scale`: what the target's embedding module multiplies its rows by (target_embed_scale)."""
        tc = target_config
        rope = target_rope(tc)
        dspark = algorithm == "dspark"
        if algorithm == "eagle3":
            block_size, mask_token_id, sample_from_anchor = ttt_steps, -1, True
            draft_vocab_size = min(draft_vocab_size, tc.vocab_size)
        else:
            ttt_steps = draft_vocab_size = 0
        if not -1 <= mask_token_id < tc.vocab_size:
            raise ValueError(f"mask_token_id {mask_token_id} is not a token of the target (vocab {tc.vocab_size})")
        return cls(algorithm=algorithm, target_layers=list(target_layers), target_hidden_size=tc.hidden_size,
                   vocab_size=tc.vocab_size, block_size=block_size, num_layers=num_layers,
                   hidden_size=tc.hidden_size, num_heads=tc.num_attention_heads,
                   num_kv_heads=tc.num_key_value_heads,
                   head_dim=getattr(tc, "head_dim", None) or tc.hidden_size // tc.num_attention_heads,
                   intermediate_size=tc.intermediate_size, rms_norm_eps=tc.rms_norm_eps,
                   rope_theta=rope["rope_theta"], rope_parameters=rope,
                   max_position_embeddings=int(getattr(tc, "max_position_embeddings", None) or 32768),
                   embed_scale=embed_scale,
                   markov_rank=markov_rank if dspark else 0, confidence=dspark, mask_token_id=mask_token_id,
                   mask_token=mask_token if mask_token_id >= 0 else "", sample_from_anchor=sample_from_anchor,
                   ttt_steps=ttt_steps, draft_vocab_size=draft_vocab_size, target=identity)

    def rope(self) -> dict:
        """transformers' `rope_parameters` for the draft's rotary embedding."""
        return {"rope_type": "default", **self.rope_parameters, "rope_theta": self.rope_theta}

    def qwen3(self) -> Qwen3Config:
        return Qwen3Config(vocab_size=self.vocab_size, hidden_size=self.hidden_size,
                           intermediate_size=self.intermediate_size, num_hidden_layers=self.num_layers,
                           num_attention_heads=self.num_heads, num_key_value_heads=self.num_kv_heads,
                           head_dim=self.head_dim, rms_norm_eps=self.rms_norm_eps, rope_parameters=self.rope(),
                           max_position_embeddings=self.max_position_embeddings, attention_bias=False)


def target_rope(target_config) -> dict:
    """The target's RoPE as transformers' `rope_parameters` (type, theta, scaling). A target with one
    RoPE per attention type (Gemma 3: local layers at 10k, global at 1M) gives its full-attention
    one: draft layers attend to the whole context."""
    rp = dict(getattr(target_config, "rope_parameters", None) or {})
    if isinstance(rp.get("full_attention"), dict):
        rp = dict(rp["full_attention"])
    theta = rp.get("rope_theta") or getattr(target_config, "rope_theta", None) or 10000.0
    return {**rp, "rope_type": rp.get("rope_type", "default"), "rope_theta": float(theta)}


class DraftLayer(nn.Module):
    def __init__(self, config: Qwen3Config, index: int):
        super().__init__()
        self.self_attn = Qwen3Attention(config, index)
        self.mlp = Qwen3MLP(config)
        self.input_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.index = index

    def _kv(self, x: torch.Tensor, cos, sin) -> tuple[torch.Tensor, torch.Tensor]:
        a = self.self_attn
        shape = (*x.shape[:-1], -1, a.head_dim)
        k = a.k_norm(a.k_proj(x).view(shape)).transpose(1, 2)
        v = a.v_proj(x).view(shape).transpose(1, 2)
        k = k * cos.unsqueeze(1) + rotate_half(k) * sin.unsqueeze(1)
        return k, v

    def forward(self, h: torch.Tensor, ctx: torch.Tensor, rope_ctx, rope_blk, mask: torch.Tensor | None,
                cache=None) -> torch.Tensor:
        """h: [B, Q, H] block states; ctx: [B, S, H] context features (new ones only when cached)."""
        a = self.self_attn
        x = self.input_layernorm(h)
        shape = (*x.shape[:-1], -1, a.head_dim)
        q = a.q_norm(a.q_proj(x).view(shape)).transpose(1, 2)
        k_blk = a.k_norm(a.k_proj(x).view(shape)).transpose(1, 2)
        v_blk = a.v_proj(x).view(shape).transpose(1, 2)
        q, k_blk = apply_rotary_pos_emb(q, k_blk, *rope_blk)
        k_ctx, v_ctx = self._kv(ctx, *rope_ctx)
        if cache is not None:  # context keys only ever grow; block keys are never stored
            k_ctx, v_ctx = cache.update(k_ctx, v_ctx, self.index)
        k = torch.cat([k_ctx, k_blk], dim=2)
        v = torch.cat([v_ctx, v_blk], dim=2)
        out = attend(q, k, v, mask, a.scaling, a.num_key_value_groups > 1)
        h = h + a.o_proj(out.transpose(1, 2).reshape(*h.shape[:-1], -1))
        return h + self.mlp(self.post_attention_layernorm(h))


class DraftModel(nn.Module):
    FROZEN = ("embed_tokens.weight", "lm_head.weight")

    def __init__(self, config: DraftConfig):
        super().__init__()
        self.config = config
        qc = config.qwen3()
        H, V = config.hidden_size, config.vocab_size
        self.embed_tokens = nn.Embedding(V, H)
        self.lm_head = nn.Linear(H, V, bias=False)
        self.fc = nn.Linear(config.target_hidden_size * len(config.target_layers), H, bias=False)
        self.hidden_norm = Qwen3RMSNorm(H, eps=config.rms_norm_eps)
        # only a learned mask has its own parameter; a token's row is read from the frozen embeddings
        self.mask_embedding = nn.Parameter(torch.zeros(H, device="cpu")) if config.mask_token_id < 0 else None
        self.layers = nn.ModuleList(DraftLayer(qc, i) for i in range(config.num_layers))
        self.norm = Qwen3RMSNorm(H, eps=config.rms_norm_eps)
        self.rotary = Qwen3RotaryEmbedding(qc)
        r = config.markov_rank
        self.markov_in = nn.Embedding(V, r) if r > 0 else None
        self.markov_out = nn.Linear(r, V, bias=False) if r > 0 else None
        self.confidence_head = nn.Linear(H + r, 1) if config.confidence else None
        self._init_weights()

    def _init_weights(self) -> None:
        for name, p in self.named_parameters():
            if name in self.FROZEN or p.ndim < 2:
                continue
            nn.init.normal_(p, std=0.02)
        if self.mask_embedding is not None:
            nn.init.normal_(self.mask_embedding, std=0.02)
        if self.markov_out is not None:
            nn.init.zeros_(self.markov_out.weight)  # start as "no bias": the Markov head learns a correction

    def copy_target_embeddings(self, target) -> None:
        """Copy a loaded target's input embeddings and lm_head, then freeze them."""
        self.set_target_embeddings(target.get_input_embeddings().weight, target.get_output_embeddings().weight)

    def set_target_embeddings(self, embed: torch.Tensor, head: torch.Tensor) -> None:
        """The target's input embeddings and lm_head [V, H] (models.target.embedding_weights), frozen."""
        with torch.no_grad():
            self.embed_tokens.weight.copy_(embed)
            self.lm_head.weight.copy_(head)
        self.freeze_embeddings()

    def freeze_embeddings(self) -> None:
        self.embed_tokens.weight.requires_grad_(False)
        self.lm_head.weight.requires_grad_(False)

    # ---- the shared forward ---------------------------------------------------------------------
    def context(self, hidden: torch.Tensor) -> torch.Tensor:
        """[.., L*H_target] concatenated target features -> [.., H] fused context."""
        return self.hidden_norm(self.fc(hidden))

    def block_states(self, anchor_tokens: torch.Tensor, anchor_pos: torch.Tensor, ctx: torch.Tensor,
                     ctx_pos: torch.Tensor, mask: torch.Tensor | None, cache=None) -> torch.Tensor:
        """anchor_tokens/anchor_pos: [B, N]; ctx: [B, S, H]; ctx_pos: [B, S] -> [B, N, γ, H] (every slot;
        `drafts()` picks the ones that draft)."""
        B, N = anchor_tokens.shape
        g = self.config.block_size
        slots = self.mask_vector().to(ctx.dtype).expand(B, N, g, -1).clone()
        slots[:, :, 0] = self.embed(anchor_tokens).to(ctx.dtype)
        h = slots.reshape(B, N * g, -1)
        blk_pos = (anchor_pos[:, :, None] + torch.arange(g, device=ctx.device)).reshape(B, N * g)
        rope_blk = self.rotary(h, blk_pos)
        rope_ctx = self.rotary(ctx, ctx_pos)
        for layer in self.layers:
            h = layer(h, ctx, rope_ctx, rope_blk, mask, cache)
        return self.norm(h).view(B, N, g, -1)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return target_embed(self.embed_tokens, tokens, self.config.embed_scale)

    def mask_vector(self) -> torch.Tensor:
        if self.mask_embedding is not None:
            return self.mask_embedding
        return self.embed(torch.tensor(self.config.mask_token_id, device=self.embed_tokens.weight.device))

    def drafts(self, h: torch.Tensor) -> torch.Tensor:
        """[.., γ, H] block states -> [.., num_drafts, H]: draft j's state (it predicts token a+j+1)."""
        return h[..., self.config.draft_offset:, :]

    def markov_bias(self, prev: torch.Tensor) -> torch.Tensor | None:
        return None if self.markov_in is None else self.markov_out(self.markov_in(prev))

    def confidence(self, h: torch.Tensor, prev: torch.Tensor) -> torch.Tensor | None:
        if self.confidence_head is None:
            return None
        extra = [self.markov_in(prev).to(h.dtype)] if self.markov_in is not None else []
        return self.confidence_head(torch.cat([h, *extra], dim=-1)).squeeze(-1).float()

    def logits(self, h: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        out = self.lm_head(h).float()
        bias = self.markov_bias(prev)
        return out if bias is None else out + bias.float()

    def forward(self, batch: dict, anchors, ce_w: float, l1_w: float, conf_w: float, decay_gamma: float,
                norm: float | None = None):
        """Training forward (the loss): DDP needs the loss computed inside forward()."""
        return draft_loss(self, batch, anchors, ce_w, l1_w, conf_w, decay_gamma, norm)

    # ---- save / load -----------------------------------------------------------------------------
    def save(self, out_dir: str | Path) -> None:
        save_draft(self, out_dir)

    @classmethod
    def load(cls, path: str | Path, device: str | torch.device = "cpu") -> "DraftModel":
        """A DSpark or DFlash draft directory (any algorithm's: models.registry.load_draft)."""
        config = read_draft_config(path)
        if config.algorithm not in ("dspark", "dflash"):
            raise ValueError(f"{path}: a {config.algorithm} draft (load it with models.registry.load_draft)")
        return load_weights(cls(config), path).to(device)


def target_embed(embedding: nn.Embedding, tokens: torch.Tensor, scale: float) -> torch.Tensor:
    """What the target's embedding module gives for `tokens` (engines feed the draft from it): the
    rows times its scale, applied in the weights' dtype as Gemma's scaled embedding does."""
    out = embedding(tokens)
    return out if scale == 1.0 else out * torch.tensor(scale, dtype=out.dtype, device=out.device)


def read_draft_config(path: str | Path) -> DraftConfig:
    return DraftConfig(**json.loads((Path(path) / "config.json").read_text()))


def load_weights(model: nn.Module, path: str | Path) -> nn.Module:
    """`model.safetensors` of a draft directory into a model built from its config; frozen embeddings."""
    from safetensors.torch import load_file

    state = load_file(str(Path(path) / "model.safetensors"), device="cpu")
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.startswith("rotary.")]
    if missing or unexpected:
        raise ValueError(f"{path}: draft weights do not match its config (missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]})")
    model.freeze_embeddings()
    return model


def save_draft(model: nn.Module, out_dir: str | Path) -> None:
    """config.json + model.safetensors (every persistent tensor but the recomputed rotary buffers)."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(asdict(model.config), indent=2, sort_keys=True) + "\n")
    tensors = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items() if not k.startswith("rotary.")}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "deepspec-draft"})
