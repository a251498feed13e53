"""Value encodings: the table-driven fp8 decode is exactly torch's fp8 -> float32 -> bfloat16 path."""
import numpy as np
import pytest
import torch

from deepspec.cache.spec.format import decode_hidden, encode_hidden


def torch_decode(bits: np.ndarray, scale: np.ndarray) -> torch.Tensor:
    x = torch.from_numpy(np.ascontiguousarray(bits)).view(torch.float8_e4m3fn).float()
    return (x * torch.from_numpy(scale).unsqueeze(-1)).to(torch.bfloat16)


@pytest.mark.parametrize("width", [1, 127, 128, 1920])  # odd widths take the one-byte table
def test_fp8_decode_equals_torch_cast_bitwise(width):
    g = torch.Generator().manual_seed(width)
    x = torch.randn(257, width, generator=g) * torch.logspace(-4, 4, 257).unsqueeze(-1)
    x[3] = 0  # an all-zero row has scale 1
    bits, scale = encode_hidden(x, "fp8")
    want = torch_decode(bits, scale).view(torch.int16)
    assert torch.equal(decode_hidden(bits, scale, "fp8").view(torch.int16), want)
    out = torch.full((257, width), 7.0, dtype=torch.bfloat16)
    decode_hidden(bits, scale, "fp8", out=out)
    assert torch.equal(out.view(torch.int16), want)
    rel = (decode_hidden(bits, scale, "fp8").float() - x).norm() / x.norm()
    assert rel < 0.05


def test_fp8_decode_covers_every_byte_value():
    bits = np.arange(256, dtype=np.uint8).reshape(2, 128)
    scale = np.array([1.0, -2.5], dtype=np.float32)
    want, got = torch_decode(bits, scale).float(), decode_hidden(bits, scale, "fp8").float()
    assert torch.equal(want.isnan(), got.isnan())  # 0x7f and 0xff are NaN in e4m3fn
    assert torch.equal(want.nan_to_num(), got.nan_to_num())
