"""`deepspec cache estimate --config`: the cache stage's memory per GPU for a target sharded k ways,
on paper. The arithmetic is checked by hand on a tiny shape, the parameter counts against models
transformers builds (random init, no download) and against the shards its tensor-parallel plan gives
rank 0, and the docs' table against the CLI."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from deepspec.cache.tools.estimate import GB, activation_bytes, estimate_memory, markdown_rows, refusal, shape_of, \
    weight_elements
from deepspec.cli import main

LLAMA_70B = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 8192,
             "num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8,
             "intermediate_size": 28672, "vocab_size": 128256, "tie_word_embeddings": False}
QWEN3_4B = {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "hidden_size": 2560,
            "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
            "intermediate_size": 9728, "vocab_size": 151936, "tie_word_embeddings": True}
SMOLLM2 = {"model_type": "llama", "hidden_size": 576, "num_hidden_layers": 30, "num_attention_heads": 9,
           "num_key_value_heads": 3, "intermediate_size": 1536, "vocab_size": 49152, "tie_word_embeddings": True}
# small enough to build: dense Qwen3 (GQA, per-head q/k norms), Llama with biases, two MoE layouts
TINY = {"model_type": "qwen3", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 96, "vocab_size": 250,
        "tie_word_embeddings": False}
TINY_TIED = {**TINY, "tie_word_embeddings": True}
TINY_LLAMA = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 4, "intermediate_size": 80, "vocab_size": 251, "attention_bias": True,
              "tie_word_embeddings": False}
TINY_QWEN3_MOE = {"model_type": "qwen3_moe", "hidden_size": 64, "num_hidden_layers": 3, "num_attention_heads": 4,
                  "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 96, "moe_intermediate_size": 40,
                  "num_experts": 4, "num_experts_per_tok": 2, "mlp_only_layers": [1], "vocab_size": 251,
                  "tie_word_embeddings": False}
TINY_MIXTRAL = {"model_type": "mixtral", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 48, "num_local_experts": 4,
                "num_experts_per_tok": 2, "vocab_size": 251, "tie_word_embeddings": False}
BUILT = {"tiny": TINY, "tiny_tied": TINY_TIED, "tiny_llama": TINY_LLAMA, "tiny_qwen3_moe": TINY_QWEN3_MOE,
         "tiny_mixtral": TINY_MIXTRAL}
LAYERS_70B, LAYERS_4B = [1, 20, 39, 58, 77], [1, 9, 17, 25, 33]
SCALE_MD = Path(__file__).resolve().parents[2] / "docs" / "scale.md"


def write(tmp_path: Path, name: str, config: dict) -> Path:
    path = tmp_path / name / "config.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(config))
    return path


def test_weights_by_hand_sum_to_the_total_at_k1_and_the_sharded_part_halves(tmp_path):
    s = shape_of(write(tmp_path, "tiny", TINY))
    # a layer: q 64x64 + k, v 32x64 each + o 64x64 = 12,288; gate/up/down 3 x 64 x 96 = 18,432;
    # embedding and lm_head 250 x 64 each; norms 2 x 64 a layer, q/k norms 2 x 16, the final 64
    assert weight_elements(s, 1) == (2 * (12288 + 18432) + 2 * 250 * 64, 2 * (128 + 32) + 64) == (93440, 384)
    assert weight_elements(s, 2) == (93440 // 2, 384)            # every sharded width divides by 2
    assert weight_elements(s, 4) == (2 * (12288 + 18432) // 4 + 2 * 63 * 64, 384)   # 250 rows: rank 0 holds 63
    # vocabulary 251 over 2 ranks: rank 0 holds 126 rows of each of the two matrices
    assert weight_elements(shape_of(write(tmp_path, "v251", {**TINY, "vocab_size": 251})), 2)[0] == \
        93440 // 2 + 2 * 64 * (126 - 125)
    tied = shape_of(write(tmp_path, "tied", TINY_TIED))
    assert weight_elements(tied, 1) == (93440 - 250 * 64, 384)     # lm_head is the embedding's matrix
    out = estimate_memory(write(tmp_path, "tiny2", TINY), [1, 2], [0, 1], 1024, max_length=128, overhead_gib=0)
    one, two = out["tensor_parallel"]
    assert out["params"] == 93824 and one["weights_bytes"] == 2 * 93824
    assert two["weights_sharded_bytes"] * 2 == one["weights_sharded_bytes"]
    assert two["weights_replicated_bytes"] == one["weights_replicated_bytes"] == 2 * 384


def test_activation_formula_by_hand(tmp_path):
    s = shape_of(write(tmp_path, "tiny", TINY))
    n, a = 1024, 2
    fixed = n * 16 + 2 * n * 16 * a + n * 128            # ids + mask int64, RoPE cos/sin, a bool [B,1,T,T] mask
    states = 3 * n * 64 * a                              # layers 0, 1 and the last normed state
    # k = 1: attention (norm out 64, q/k/v 64+32+32, rotated q/k 64+32, repeated k/v 2x64, output and copy
    # 2x64, o_proj out 64) = 608 wide beats the MLP's 64 + 3 x 96 + 64 = 416 and the norm's 8 x 64 bytes
    got = activation_bytes(s, 1, n, 3, a, "bfloat16", 128)
    assert got["layer_peak_bytes"] == n * 64 * a + n * a * 608
    assert got["peak_bytes"] == fixed + states + n * 64 * a + n * a * 608 and got["peak_at"] == "forward"
    # k = 2: heads halve (64 + 32+16+16 + 32+16 + 2x32 + 2x32 + 2x64 all-reduced = 432), MLP 64 + 3 x 48 + 2 x 64
    got = activation_bytes(s, 2, n, 3, a, "bfloat16", 128)
    assert got["layer_peak_bytes"] == n * 64 * a + n * a * 432
    assert got["captured_states_bytes"] == states                 # full width on every rank
    # a wide MLP: its gate activation, up and product (3 x 1,024) beside the norm's output
    wide = shape_of(write(tmp_path, "wide", {**TINY, "intermediate_size": 1024}))
    assert activation_bytes(wide, 1, n, 3, a, "bfloat16", 128)["layer_peak_bytes"] == n * 64 * a + n * a * (64 + 3072)
    # fp8: the encode keeps 1 byte + a 4-byte scale a row, and one layer's float32 working copies
    fp8 = activation_bytes(s, 1, n, 3, a, "fp8", 128)
    assert fp8["encoded_bytes"] == 3 * n * (64 + 4)


def test_divisibility_refusal_on_smollm2s_nine_heads(tmp_path, capsys):
    s = shape_of(write(tmp_path, "smol", SMOLLM2))
    assert refusal(s, 1) is None and refusal(s, 3) is None
    assert "num_attention_heads=9 and num_key_value_heads=3" in refusal(s, 2)
    assert main(["cache", "estimate", "--config", str(write(tmp_path, "smol", SMOLLM2)), "--tensor-parallel",
                 "2,3", "--layers", "1,15,29"]) == 0
    captured = capsys.readouterr()
    out = json.loads(captured.out)["tensor_parallel"]
    assert out[0]["k"] == 2 and out[0]["refused"] and "weights_bytes" not in out[0]
    assert out[1]["k"] == 3 and out[1]["refused"] is None and out[1]["weights_bytes"] > 0
    assert "refused: k=2" in captured.err


def test_cli_prints_json_for_the_70b_shape(tmp_path, capsys):
    path = write(tmp_path, "llama70b", LLAMA_70B)
    assert main(["cache", "estimate", "--config", str(path), "--tensor-parallel", "4,8",
                 "--layers", ",".join(map(str, LAYERS_70B))]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["params"] == 70_553_706_496                         # Llama-3-70B's published count
    assert out["batch_tokens"] == 8192                             # CacheConfig's default
    four, eight = out["tensor_parallel"]
    assert four["k"] == 4 and eight["k"] == 8
    assert four["weights_bytes"] == pytest.approx(2 * 70_553_706_496 / 4, rel=1e-4)
    assert eight["weights_sharded_bytes"] * 2 == four["weights_sharded_bytes"]
    # (5 layers + the last) x 8,192 tokens x 8,192 x 2 bytes on every rank, whatever k
    assert four["activations"]["captured_states_bytes"] == eight["activations"]["captured_states_bytes"] == \
        6 * 8192 * 8192 * 2
    assert four["fits"] == {"80GB": True, "141GB": True} and eight["total_bytes"] < four["total_bytes"]
    # the store's size beside it (--tokens), and an out-of-range layer refused
    assert main(["cache", "estimate", "--config", str(path), "--layers", "1,79", "--tokens", "1e6"]) == 0
    assert json.loads(capsys.readouterr().out)["store"]["hidden_size"] == 8192
    assert main(["cache", "estimate", "--config", str(path), "--layers", "1,80"]) == 1
    assert "outside -1..79" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["cache", "estimate", "--layers", "1"])               # neither --config nor --hidden-size/--tokens


@pytest.mark.parametrize("name", sorted(BUILT))
def test_parameter_count_of_a_model_transformers_builds(tmp_path, name):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    path = write(tmp_path, name, BUILT[name])
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(path), local_files_only=True))
    params = sum(p.numel() for p in model.parameters())          # a tied matrix once
    assert sum(weight_elements(shape_of(path), 1)) == params
    out = estimate_memory(path, [1], [0], 256, weights_dtype="float32")
    assert out["tensor_parallel"][0]["weights_bytes"] == 4 * params


SHARDED = textwrap.dedent("""
    import json, sys
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    k = int(sys.argv[1])
    # a fake process group: rank 0 of k, collectives no-ops; only the shards' shapes are looked at
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=k)
    counts = {}
    for path in sys.argv[2:]:
        saved = path + ".model"
        AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path, local_files_only=True)).save_pretrained(saved)
        model = AutoModelForCausalLM.from_pretrained(saved, distributed_config=DistributedConfig(tp_size=k))
        counts[path] = sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in model.parameters())
    print(json.dumps(counts))
""")


@pytest.mark.parametrize("k", [2, 4])
def test_rank_zeros_shards_under_transformers_plan_match(tmp_path, k):
    """Each built model saved and loaded as the stage loads a sharded target (from_pretrained with a
    DistributedConfig(tp_size=k): transformers' own plan), as rank 0 of a fake k-rank group, in a
    subprocess so no process group outlives the test: rank 0's parameters are what weight_elements
    counts, embedding and lm_head vocabulary-sharded (uneven vocabularies, tied matrices included)."""
    pytest.importorskip("torch.testing._internal.distributed.fake_pg")
    paths = [str(write(tmp_path, name, config)) for name, config in BUILT.items()]
    run = subprocess.run([sys.executable, "-c", SHARDED, str(k), *paths], capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    counts = json.loads(run.stdout.strip().splitlines()[-1])
    for path in paths:
        assert sum(weight_elements(shape_of(path), k)) == counts[path], path


def table(tmp_path: Path, config: dict, layers: list[int], batch_tokens: int, capsys) -> list[str]:
    path = write(tmp_path, config["model_type"], config)
    assert main(["cache", "estimate", "--config", str(path), "--tensor-parallel", "1,2,4,8", "--layers",
                 ",".join(map(str, layers)), "--batch-tokens", str(batch_tokens), "--markdown"]) == 0
    return capsys.readouterr().out.strip().splitlines()


def test_the_docs_table_is_what_the_cli_prints(tmp_path, capsys):
    docs = SCALE_MD.read_text()
    for config, layers in ((LLAMA_70B, LAYERS_70B), (QWEN3_4B, LAYERS_4B)):
        for batch_tokens in (8192, 65536):
            for row in table(tmp_path, config, layers, batch_tokens, capsys):
                assert row in docs, f"docs/scale.md lacks (batch_tokens {batch_tokens}): {row}"


def test_70b_needs_two_80gb_cards_and_qwen3_4b_one(tmp_path):
    big = estimate_memory(write(tmp_path, "l", LLAMA_70B), [1, 2, 4, 8], LAYERS_70B, 8192)["tensor_parallel"]
    assert [r["fits"]["80GB"] for r in big] == [False, True, True, True]
    assert not big[0]["fits"]["141GB"]                            # 141 GB of bf16 weights alone at k = 1
    small = estimate_memory(write(tmp_path, "q", QWEN3_4B), [1], LAYERS_4B, 8192)
    assert small["params"] == pytest.approx(4.02e9, rel=0.01)     # Qwen3-4B's published 4.0 B
    assert small["tensor_parallel"][0]["total_bytes"] < 20 * GB
    assert markdown_rows(small)[0].startswith("| 1 | ")
