"""Cache size arithmetic (deepspec's layout next to the reference's raw layout), and the cache stage's
memory per GPU for a target sharded over k ranks (estimate_memory), both on paper."""
from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

from deepspec.cache.spec.format import bytes_per_token


def reference_bytes_per_token(hidden_size: int, num_layers: int) -> int:
    """The reference's raw shards: int32 ids + uint8 attention mask + uint8 loss mask + bf16 rows."""
    return 4 + 1 + 1 + num_layers * hidden_size * 2 + hidden_size * 2


def estimate(hidden_size: int, layers: list[int], tokens: int, dtype: str = "bfloat16",
             chunk_tokens: int = 64) -> dict:
    per_token = bytes_per_token(hidden_size, len(layers), dtype)
    # each inner chunk of every hidden array carries a 4-byte crc32c and a 16-byte index entry
    overhead = (len(layers) + 1) * 20 / chunk_tokens
    ref = reference_bytes_per_token(hidden_size, len(layers))
    return {
        "hidden_size": hidden_size,
        "layers": list(layers),
        "tokens": tokens,
        "dtype": dtype,
        "reference_bytes_per_token": ref,
        "bytes_per_token": round(per_token + overhead, 2),
        "total_bytes": round((per_token + overhead) * tokens),
        "reference_total_bytes": ref * tokens,
        "ratio_vs_reference": round((per_token + overhead) / ref, 4),
    }


# --- the cache stage's per-GPU memory for a target sharded k ways (cache.tensor_parallel) -------------

GB = 10**9
# "fits" is judged against the cards' nominal capacity in decimal GB, a little under what torch can
# allocate on them (an 80 GB H100 reports ~85e9 bytes, a 141 GB H200 ~150e9): conservative by ~5 GB
CARDS = {"80GB": 80 * GB, "141GB": 141 * GB}
WEIGHT_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
# architectures whose attention normalises q and k per head (a head_dim-wide RMSNorm each, replicated)
QK_NORM = {"qwen3", "qwen3_moe", "gemma3", "gemma3_text"}
ASSUMPTIONS = [  # docs/scale.md states them in full next to its tables
    "weights: transformers' tensor-parallel plan: q/k/v, gate/up, experts' gate_up column-sharded; o/down "
    "row-sharded; embedding and lm_head vocabulary-sharded; norms, row-sharded biases, an MoE router replicated; "
    "the largest rank (ceil(n/k) rows) counted",
    "no logits: the capture runs the base model, never lm_head (its weights are loaded); no KV cache, no gradients",
    "a fused attention kernel (SDPA): no [T, T] scores (eager, for soft-capping: counted at T = max_length); k and "
    "v repeated to the query heads under a padding mask: counted",
    "activations of one forward of batch_tokens padded tokens: the residual stream beside the largest of one "
    "layer's RMSNorm (two float32 copies), attention and MLP working sets (split by k; row-sharded outputs full "
    "width, twice with k > 1: out-of-place all-reduce); MoE as if all routed tokens ran at once",
    "captured states: (len(layers) + 1) x batch_tokens x hidden, full width on every rank, one batch's at the "
    "forward's peak (forward_batches lets the previous batch's go once its copies are queued); the device-to-host "
    "copy done by then",
    "also: ids and mask, RoPE cos/sin, the [B, 1, T, T] padding mask at T = max_length",
]


@dataclass(frozen=True)
class TargetShape:
    model_type: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied: bool
    attention_bias: bool = False
    qk_norm: bool = False
    eager: bool = False              # attention-logit soft-capping: deepspec runs these in eager attention
    tp_plan: bool = True             # transformers has a tensor-parallel plan for the architecture
    experts: int = 0
    experts_per_token: int = 0
    expert_intermediate: int = 0
    moe_layers: int = 0              # decoder layers whose MLP is the sparse one


def shape_of(path: str | Path) -> TargetShape:
    """A model directory or a config.json, parsed by transformers offline (no hub lookup)."""
    from transformers import AutoConfig

    c = AutoConfig.from_pretrained(str(path), local_files_only=True).get_text_config()
    heads = c.num_attention_heads
    experts = getattr(c, "num_experts", None) or getattr(c, "num_local_experts", None) or 0
    moe_layers = 0
    if experts:
        # Qwen3-MoE: layer i is sparse unless listed dense or off the sparse step; Mixtral: every layer
        dense, step = set(getattr(c, "mlp_only_layers", None) or []), getattr(c, "decoder_sparse_step", 1) or 1
        moe_layers = sum(1 for i in range(c.num_hidden_layers) if i not in dense and (i + 1) % step == 0)
    return TargetShape(
        model_type=c.model_type, hidden=c.hidden_size, layers=c.num_hidden_layers, heads=heads,
        kv_heads=getattr(c, "num_key_value_heads", None) or heads,
        head_dim=getattr(c, "head_dim", None) or c.hidden_size // heads,
        intermediate=c.intermediate_size, vocab=c.vocab_size, tied=bool(getattr(c, "tie_word_embeddings", False)),
        attention_bias=bool(getattr(c, "attention_bias", False)), qk_norm=c.model_type in QK_NORM,
        eager=bool(getattr(c, "attn_logit_softcapping", None)), tp_plan=bool(getattr(c, "base_model_tp_plan", None)),
        experts=experts,
        experts_per_token=getattr(c, "num_experts_per_tok", 0) if experts else 0,
        expert_intermediate=(getattr(c, "moe_intermediate_size", None) or c.intermediate_size) if experts else 0,
        moe_layers=moe_layers)


def refusal(s: TargetShape, k: int) -> str | None:
    """Why k ranks cannot hold the target, or None. The plan splits whole heads: with k not dividing the
    query or KV heads a rank's q/k/v width is no whole number of heads (transformers refuses the KV heads
    in get_kv_heads_per_rank; the attention's view fails at the first forward)."""
    if k < 1:
        return f"tensor_parallel must be >= 1, got {k}"
    if k > 1 and not s.tp_plan:
        return f"{s.model_type} has no tensor-parallel plan in transformers (base_model_tp_plan)"
    bad = [f"{name}={n}" for name, n in (("num_attention_heads", s.heads), ("num_key_value_heads", s.kv_heads))
           if n % k]
    return f"k={k} does not divide {' and '.join(bad)}: a rank would hold a fraction of a head" if bad else None


def weight_elements(s: TargetShape, k: int) -> tuple[int, int]:
    """(sharded, replicated) parameter counts on the largest rank."""
    def part(n: int) -> int:
        return -(-n // k)

    q, kv = part(s.heads * s.head_dim), part(s.kv_heads * s.head_dim)
    attention = (q + 2 * kv) * s.hidden + q * s.hidden + (q + 2 * kv if s.attention_bias else 0)
    dense_mlp = 3 * s.hidden * part(s.intermediate)
    sparse_mlp = s.experts * 3 * s.hidden * part(s.expert_intermediate)
    embeddings = part(s.vocab) * s.hidden * (1 if s.tied else 2)     # tied: lm_head is the embedding's matrix
    sharded = s.layers * attention + (s.layers - s.moe_layers) * dense_mlp + s.moe_layers * sparse_mlp + embeddings
    per_layer_norms = 2 * s.hidden + (2 * s.head_dim if s.qk_norm else 0)
    # o_proj's bias: a row-sharded layer keeps its bias whole
    replicated = (s.layers * per_layer_norms + s.hidden + s.moe_layers * s.experts * s.hidden
                  + (s.layers * s.hidden if s.attention_bias else 0))
    return sharded, replicated


def activation_bytes(s: TargetShape, k: int, batch_tokens: int, captured: int, a: int, store_dtype: str,
                     max_length: int) -> dict[str, int]:
    """The device's activation peak on one rank for one forward of `batch_tokens` padded tokens
    (ASSUMPTIONS lists what is counted); `captured` = len(layers) + 1, `a` = bytes of the weights' dtype."""
    def part(n: int) -> int:
        return -(-n // k)

    n, h = batch_tokens, s.hidden
    q, kv = part(s.heads * s.head_dim), part(s.kv_heads * s.head_dim)
    reduced = 2 if k > 1 else 1          # a row-sharded output and its all-reduced copy
    fixed = n * 16 + 2 * n * s.head_dim * a + n * max_length * (a if s.eager else 1)
    norm = 8 * n * h
    attention = n * a * (h + (q + 2 * kv) + (q + kv) + (2 * q if s.kv_heads != s.heads else 0) + 2 * q
                         + reduced * h)
    if s.eager:
        attention += n * max_length * part(s.heads) * (2 * a + 4)
    # gate's activation, up and their product are alive at the product; then the product and down's output
    i = part(s.intermediate)
    mlp = n * a * (h + max(3 * i, i + reduced * h)) if s.moe_layers < s.layers else 0
    moe = 0
    if s.moe_layers:
        t = s.experts_per_token
        moe = (n * a * (h + t * h + 3 * t * part(s.expert_intermediate) + (1 + reduced) * h)
               + n * s.experts * (a + 4) + n * t * (s.experts + 1) * 8)
    layer = n * h * a + max(norm, attention, mlp, moe)    # the residual stream beside the largest step
    states = captured * n * h * a
    if store_dtype == "fp8":
        encoded, encoding = captured * n * (h + 4), n * h * (a + 12)   # one layer's float32 working copies at a time
    else:
        encoded, encoding = captured * n * h * 2, (n * h * a if a != 2 else 0)
    forward, encode = fixed + states + layer, fixed + states + encoded + encoding
    return {"fixed_bytes": fixed, "layer_peak_bytes": layer, "captured_states_bytes": states,
            "encoded_bytes": encoded, "peak_at": "forward" if forward >= encode else "encode",
            "held_states_bytes": states if forward >= encode else states + encoded + encoding,
            "peak_bytes": max(forward, encode)}


def estimate_memory(config: str | Path, tensor_parallel: list[int], layers: list[int], batch_tokens: int,
                    weights_dtype: str = "bfloat16", store_dtype: str = "bfloat16", max_length: int = 1024,
                    overhead_gib: float = 2.0) -> dict:
    """Per-GPU memory of the cache stage for each k in `tensor_parallel`, on paper, from the config."""
    s = shape_of(config)
    if bad := [i for i in layers if not -1 <= i < s.layers]:
        raise ValueError(f"layers {bad} are outside -1..{s.layers - 1} ({s.layers} decoder layers)")
    a = WEIGHT_BYTES[weights_dtype]
    overhead = round(overhead_gib * 2**30)
    rows = []
    for k in tensor_parallel:
        if why := refusal(s, k):
            rows.append({"k": k, "refused": why})
            continue
        sharded, replicated = weight_elements(s, k)
        act = activation_bytes(s, k, batch_tokens, len(layers) + 1, a, store_dtype, max_length)
        total = (sharded + replicated) * a + act["peak_bytes"] + overhead
        rows.append({"k": k, "refused": None, "weights_sharded_bytes": sharded * a,
                     "weights_replicated_bytes": replicated * a, "weights_bytes": (sharded + replicated) * a,
                     "activations": act, "overhead_bytes": overhead, "total_bytes": total,
                     "total_gb": round(total / GB, 1), "fits": {card: total <= cap for card, cap in CARDS.items()}})
    return {"config": str(config), "shape": asdict(s), "params": sum(weight_elements(s, 1)),
            "batch_tokens": batch_tokens, "max_length": max_length, "layers": list(layers),
            "weights_dtype": weights_dtype, "dtype": store_dtype, "overhead_gib": overhead_gib,
            "cards_bytes": CARDS, "assumptions": ASSUMPTIONS, "tensor_parallel": rows}


def markdown_rows(out: dict) -> list[str]:
    """The table rows docs/scale.md shows: | k | weights | of them replicated | activation peak | of it
    the captured states held | allowance | total | fits 80 GB / 141 GB | (decimal GB; replicated in MB)."""
    def gb(n: int) -> str:
        return f"{n / GB:,.1f}"

    rows = []
    for r in out["tensor_parallel"]:
        if r["refused"]:
            rows.append(f"| {r['k']} | refused: {r['refused']} | | | | | | |")
            continue
        act = r["activations"]
        fits = " / ".join("yes" if r["fits"][c] else "no" for c in CARDS)
        rows.append(f"| {r['k']} | {gb(r['weights_bytes'])} | {r['weights_replicated_bytes'] / 10**6:,.1f} MB | "
                    f"{gb(act['peak_bytes'])} | {gb(act['held_states_bytes'])} | {gb(r['overhead_bytes'])} | "
                    f"**{gb(r['total_bytes'])}** | {fits} |")
    return rows
