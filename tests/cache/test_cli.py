import json

from deepspec.cache.estimate import estimate
from deepspec.cli import main


def test_estimate_reproduces_the_reference_size_for_qwen3_4b(capsys):
    assert main(["cache", "estimate", "--hidden-size", "2560", "--layers", "1,9,17,25,33", "--tokens", "1.25e9"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["reference_bytes_per_token"] == 30726
    assert abs(out["bytes_per_token"] - 30726) < 5          # ids + mask + 6 bf16 rows, plus chunk checksums
    assert 38e12 < out["total_bytes"] < 39e12               # the reference's ~38 TB
    fp8 = estimate(2560, [1, 9, 17, 25, 33], 10**9, "fp8")
    assert 0.49 < fp8["ratio_vs_reference"] < 0.52


def test_info_and_verify_on_a_real_store(small_cache, capsys):
    assert main(["cache", "info", str(small_cache)]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["layers"] == [-1, 0, 2] and info["samples"] > 0 and info["target"]["num_layers"] == 4
    assert main(["cache", "verify", str(small_cache)]) == 0
    assert json.loads(capsys.readouterr().out)["ok"] is True
    assert main(["cache", "info", str(small_cache.parent / "nope.zarr")]) == 1
    assert "not a cache store" in capsys.readouterr().err
