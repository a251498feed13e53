import json

from deepspec.cache.tools.estimate import estimate
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


def test_verify_recompute_runs_the_target_and_finds_states_that_are_not_its_own(small_cache, trained_target,
                                                                               small_model_dir, tmp_path, capsys):
    import shutil

    assert main(["cache", "verify", str(small_cache), "--recompute", "4", "--target", str(trained_target)]) == 0
    out = json.loads(capsys.readouterr().out)["recompute"]
    assert out["ok"] and out["samples_recomputed"] == 4 and out["max_relative_error"] <= out["tolerance"]
    # the bytes of one layer swapped with another's, in one part: every checksum holds, the states are wrong
    store = tmp_path / "swapped.zarr"
    shutil.copytree(small_cache, store)
    part = next((store / "parts").iterdir())
    a, b = part / "hidden" / "0" / "c", part / "hidden" / "2" / "c"
    a.rename(part / "swap")
    b.rename(a)
    (part / "swap").rename(b)
    assert main(["cache", "verify", str(store)]) == 0  # the checksums cannot tell
    capsys.readouterr()
    assert main(["cache", "verify", str(store), "--recompute", "40", "--target", str(trained_target)]) == 1
    out = json.loads(capsys.readouterr().out)["recompute"]
    assert not out["ok"] and {m["layer"] for m in out["mismatches"]} == {0, 2}
    # and a store of another target is refused before anything runs
    other = tmp_path / "other_target"
    shutil.copytree(trained_target, other)
    ident = json.loads((other / "identity.json").read_text())
    (other / "identity.json").write_text(json.dumps(dict(ident, weights_sha256="0" * 64)))
    assert main(["cache", "verify", str(small_cache), "--recompute", "1", "--target", str(other)]) == 1
    assert "computed with another target" in capsys.readouterr().err
    assert main(["cache", "verify", str(small_cache), "--recompute", "1", "--target", str(small_model_dir)]) == 1
    assert "identity.json: missing" in capsys.readouterr().err
