"""The drafts' attention pads key lengths on CUDA only, and padding changes nothing but the shape."""
import pytest
import torch
import torch.nn.functional as F
from transformers import Qwen3Config

from deepspec.models import attention
from deepspec.models.attention import KV_MULTIPLE, attend, kv_multiple
from deepspec.models.draft import DraftLayer


def qkv(q_len=21, kv_len=50, heads=4, kv_heads=2, d=8, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    q = torch.randn(2, heads, q_len, d, generator=g, dtype=torch.float64)
    k = torch.randn(2, kv_heads, kv_len, d, generator=g, dtype=torch.float64)
    v = torch.randn(2, kv_heads, kv_len, d, generator=g, dtype=torch.float64)
    mask = torch.rand(2, 1, q_len, kv_len, generator=g, dtype=torch.float64) < 0.6
    mask[..., 0] = True  # every query sees a key
    return q, k, v, mask


def test_only_cuda_pads_key_lengths():
    assert kv_multiple(torch.device("cuda", 0)) == KV_MULTIPLE > 1
    assert kv_multiple(torch.device("cpu")) == 1


@pytest.mark.parametrize("additive", [False, True])
def test_padded_keys_give_the_same_attention_and_gradients(additive):
    q, k, v, mask = qkv()
    if additive:
        mask = torch.zeros(mask.shape, dtype=torch.float64).masked_fill(~mask, float("-inf"))
    results = []
    for multiple in (1, 16, KV_MULTIPLE):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = attend(*leaves, mask, 0.3, True, multiple=multiple)
        (out * torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)).sum().backward()
        results.append((out.detach(), *(t.grad for t in leaves)))
    for got in results[1:]:
        for a, b in zip(results[0], got):
            assert a.shape == b.shape and torch.allclose(a, b, rtol=1e-12, atol=1e-12)


def test_a_call_that_spells_out_no_key_columns_runs_as_is():
    q, k, v, mask = qkv()
    ref = F.scaled_dot_product_attention(q, k, v, scale=0.3, enable_gqa=True)
    assert torch.equal(attend(q, k, v, None, 0.3, True, multiple=KV_MULTIPLE), ref)
    per_query = mask[..., :1]  # broadcasts over the keys
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=per_query, scale=0.3, enable_gqa=True)
    assert torch.equal(attend(q, k, v, per_query, 0.3, True, multiple=KV_MULTIPLE), ref)


def test_a_draft_layer_pads_where_its_device_asks_and_computes_the_same(monkeypatch):
    config = Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=48, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=8, num_hidden_layers=1)
    torch.manual_seed(0)
    layer = DraftLayer(config, 0).double()
    B, Q, S = 2, 6, 37
    h, ctx = torch.randn(B, Q, 32, dtype=torch.float64), torch.randn(B, S, 32, dtype=torch.float64)
    rope = lambda n: (torch.ones(B, n, 8, dtype=torch.float64), torch.zeros(B, n, 8, dtype=torch.float64))  # noqa: E731
    mask = torch.rand(B, 1, Q, S + Q) < 0.7
    mask[..., S:] = True
    plain = layer(h, ctx, rope(S), rope(Q), mask)
    seen = []
    real = F.scaled_dot_product_attention

    def spy(q, k, v, **kw):
        seen.append(k.shape[-2])
        return real(q, k, v, **kw)

    monkeypatch.setattr(attention, "kv_multiple", lambda device: KV_MULTIPLE)  # as on CUDA
    monkeypatch.setattr(attention.F, "scaled_dot_product_attention", spy)
    padded = layer(h, ctx, rope(S), rope(Q), mask)
    assert seen == [KV_MULTIPLE] and torch.allclose(padded, plain, rtol=1e-12, atol=1e-12)
