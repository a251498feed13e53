"""`builtin:tiny`: a real Qwen3-architecture target built here, offline, from a seed.

A byte-level BPE tokenizer (Qwen2 pre-tokenizer regex, ChatML specials, a Qwen-style template that
injects no system prompt, and a reserved `<|MASK|>` token that never occurs in text: block drafts fill
their mask slots with its embedding row, as the serving engines' DFlash/DSpark loaders do) and a 36-layer narrow Qwen3 LM trained on the split's train
conversations: full weight on assistant tokens (what the draft will have to predict), a smaller
weight on the rest (plain next-token pretraining), packed into fixed-length rows.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import math
import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from deepspec.config import SplitConfig, TinyTargetConfig
from deepspec.data.conversation import conversation_id, normalize_conversation
from deepspec.data.split import is_eval, prompt_key, split_rows
from deepspec.embedded.corpus import SIZES, generated_rows
from deepspec.data.template import encode_conversation
from deepspec.embedded.muon import Muon
from deepspec.io import hash_unit
from deepspec.models.target import default_generation_config
from deepspec.progress import progress

log = logging.getLogger(__name__)

# <|MASK|> is the name speculators and sglang add to a tokenizer that has no mask token (their default)
MASK_TOKEN = "<|MASK|>"
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", MASK_TOKEN]
# Qwen2/Qwen3 pre-tokenizer: digits split one by one, which helps a tiny model with arithmetic.
QWEN_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] | trim + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def conversation_text(turns: list[dict]) -> str:
    return "".join(f"<|im_start|>{t['role']}\n{t['content'].strip()}<|im_end|>\n" for t in turns)


def build_tokenizer(texts: list[str], vocab_size: int):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                 mask_token=MASK_TOKEN, extra_special_tokens=["<|im_start|>"],
                                 model_max_length=32768)
    hf.chat_template = CHAT_TEMPLATE
    return hf


def build_config(cfg: TinyTargetConfig, tokenizer):
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, max_position_embeddings=4096,
        rope_theta=10000.0, tie_word_embeddings=True, torch_dtype="float32",
        bos_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
    )


def cpu_bf16_fast() -> bool:
    """bf16 autocast is ~1.35x faster on CPUs with native bf16 dot products, much slower elsewhere."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


@dataclass
class Packed:
    ids: torch.Tensor      # [N, L] int64
    weight: torch.Tensor   # [N, L] float: loss weight of predicting token t from t-1


def pack(tokenizer, conversations: list[list[dict]], seq_len: int, pretrain_weight: float) -> Packed:
    """Concatenate conversations (separated by <|endoftext|>) and cut into rows of seq_len + 1."""
    eot = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    ids, weight = [], []
    for turns in conversations:
        enc = encode_conversation(tokenizer, turns)
        ids += enc.input_ids + [eot]
        weight += [1.0 if m else pretrain_weight for m in enc.loss_mask] + [0.0]
    row = seq_len + 1
    n = max(1, len(ids) // row)
    pad = n * row - len(ids)
    if pad > 0:
        ids += [eot] * pad
        weight += [0.0] * pad
    ids_t = torch.tensor(ids[: n * row]).view(n, row)
    w_t = torch.tensor(weight[: n * row]).view(n, row)
    return Packed(ids_t, w_t)


def lm_loss(model, ids: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Weighted next-token loss; returns (weighted mean, weight sum)."""
    logits = model(input_ids=ids[:, :-1]).logits.float()
    nll = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), ids[:, 1:].reshape(-1),
                                            reduction="none")
    w = weight[:, 1:].reshape(-1)
    total = w.sum().clamp_min(1e-6)
    return (nll * w).sum() / total, total


@torch.no_grad()
def heldout_loss(model, data: Packed, batch_size: int) -> float:
    """Mean NLL per assistant token (weight exactly 1) on rows never trained on."""
    model.eval()
    nll_sum, count = 0.0, 0.0
    for i in range(0, data.ids.size(0), batch_size):
        ids, w = data.ids[i:i + batch_size], data.weight[i:i + batch_size]
        mask = (w == 1.0).float()
        loss, total = lm_loss(model, ids, mask)
        nll_sum += loss.item() * total.item()
        count += total.item()
    model.train()
    return nll_sum / max(count, 1.0)


def train_tiny(cfg: TinyTargetConfig, rows: list[dict], seed: int, out_dir: Path) -> dict:
    """Build tokenizer + model from `rows` (split train rows) and save an HF model dir to out_dir."""
    from transformers import Qwen3ForCausalLM

    t0 = time.time()
    random.seed(seed)
    torch.manual_seed(seed)
    # held out by prompt, like the split: a prompt seen in training would flatter the held-out loss.
    # Extra synthetic rows only ever train; those whose prompt would be held out are dropped.
    def held_out(r: dict) -> bool:
        return hash_unit("tiny-heldout", seed, prompt_key(r["conversations"])) < cfg.heldout_fraction

    held = [r for r in rows if held_out(r) and not r.get("source", "").startswith("synthetic/")]
    train = [r for r in rows if not held_out(r)]
    tokenizer = build_tokenizer([conversation_text(r["conversations"]) for r in train], cfg.vocab_size)
    config = build_config(cfg, tokenizer)
    model = Qwen3ForCausalLM(config)
    with torch.no_grad():  # GPT-2 style: keep the residual stream's variance flat over 36 layers
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.mul_((2 * cfg.num_layers) ** -0.5)
            layer.mlp.down_proj.weight.mul_((2 * cfg.num_layers) ** -0.5)
    model.train()
    n_params = sum(p.numel() for p in model.parameters())

    train_data = pack(tokenizer, [r["conversations"] for r in train], cfg.seq_len, cfg.pretrain_weight)
    held_data = pack(tokenizer, [r["conversations"] for r in held], cfg.seq_len, cfg.pretrain_weight)
    log.info("tiny target: %d params, %d train rows of %d tokens (%d tokens), %d held-out rows",
             n_params, train_data.ids.size(0), cfg.seq_len, train_data.ids.numel(), held_data.ids.size(0))

    # Muon on the hidden weight matrices converges far faster per step than AdamW here (held-out
    # loss 1.25 vs 1.67 for the same 500 steps); embeddings and norms stay on AdamW.
    matrices = [p for n, p in model.named_parameters() if p.ndim == 2 and "embed" not in n]
    others = [p for n, p in model.named_parameters() if not (p.ndim == 2 and "embed" not in n)]
    use_bf16 = cpu_bf16_fast()
    # torch.optim.Muon orthogonalises in bf16, ~15x slower than float32 on CPUs without native bf16
    opts = [Muon(matrices, lr=cfg.muon_lr, weight_decay=cfg.weight_decay,
                 dtype=torch.bfloat16 if use_bf16 else torch.float32),
            torch.optim.AdamW(others, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)]
    base_lrs = [[g["lr"] for g in o.param_groups] for o in opts]

    def lr_at(step: int) -> float:
        if step < cfg.warmup_steps:
            return cfg.lr * (step + 1) / cfg.warmup_steps
        p = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
        return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, p))))

    gen = torch.Generator().manual_seed(seed)
    order = torch.randperm(train_data.ids.size(0), generator=gen)
    cursor, tokens_seen, loss_ema = 0, 0, None
    bar = progress(range(cfg.steps), desc="target", unit="step")
    t_train = time.time()
    for step in bar:
        if cursor + cfg.batch_size > order.numel():
            order, cursor = torch.randperm(train_data.ids.size(0), generator=gen), 0
        idx = order[cursor:cursor + cfg.batch_size]
        cursor += cfg.batch_size
        for o, lrs in zip(opts, base_lrs):
            for group, base in zip(o.param_groups, lrs):
                group["lr"] = base * lr_at(step) / cfg.lr
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=use_bf16):
            loss, _ = lm_loss(model, train_data.ids[idx], train_data.weight[idx])
        for o in opts:
            o.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        for o in opts:
            o.step()
        tokens_seen += idx.numel() * cfg.seq_len
        loss_ema = loss.item() if loss_ema is None else 0.9 * loss_ema + 0.1 * loss.item()
        bar.set_postfix(loss=f"{loss_ema:.3f}", tok_s=f"{tokens_seen / (time.time() - t_train):.0f}")
    bar.close()

    held_loss = heldout_loss(model, held_data, cfg.batch_size)
    sample = torch.randperm(train_data.ids.size(0), generator=torch.Generator().manual_seed(seed))[:64]
    final_train = heldout_loss(model, Packed(train_data.ids[sample], train_data.weight[sample]), cfg.batch_size)
    model.generation_config = default_generation_config(config.eos_token_id, config.pad_token_id,
                                                        max_new_tokens=256, bos_token_id=config.bos_token_id)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    metrics = {
        "train_loss": round(final_train, 4),
        "heldout_loss": round(held_loss, 4),
        "uniform_loss": round(math.log(len(tokenizer)), 4),
        "tokens_seen": tokens_seen,
        "params": n_params,
        "wall_time_s": round(time.time() - t0, 1),
    }
    log.info("tiny target trained: %s", json.dumps(metrics))
    return metrics


def builtin_train_rows(cfg: SplitConfig) -> list[dict]:
    """The train side of the packaged corpus under this split's seed and test fraction: what the
    builtin target learns from, whatever `split.source` the pipeline later reads (so growing the data
    lake never retrains the target, and the eval rows stay unseen)."""
    return split_rows(dataclasses.replace(cfg, source="builtin:chat")).train


def builtin_synthetic_rows(cfg: SplitConfig, n: int) -> list[dict]:
    """`n` extra generated math/code/instruction rows (a different generator seed from the packaged
    corpus) for the builtin target to learn the task formats from. Rows whose opening prompt falls on
    the eval side of this split are dropped, so the eval prompts stay unseen by construction."""
    total = sum(SIZES.values())
    sizes = {task: -(-n * k // total) for task, k in SIZES.items()}
    rows = []
    for raw in generated_rows(sizes, seed=cfg.seed + 1_000_003):
        turns = normalize_conversation(raw)
        if not is_eval(turns, cfg):
            rows.append({"id": conversation_id(turns), "task": raw["task"],
                         "source": raw["source"].replace("generated/", "synthetic/"), "conversations": turns})
    return rows[:n]


def trainer_on(rows: list[dict]):
    """prepare_target's `train_tiny` argument that trains builtin:tiny on `rows`."""
    return lambda cfg, seed, out_dir: train_tiny(cfg, rows, seed, out_dir)
