"""`deepspec cache gc` and `verify`'s unlisted parts, on every backend (docs/cache-format.md §7)."""
import json

import pytest

from deepspec.cache.spec.format import CacheFormatError
from deepspec.cache.tools.gc import collect
from deepspec.cache.write.lease import acquire
from deepspec.cache.read.reader import CacheReader
from deepspec.cache.tools.verify import verify
from deepspec.cache.write.writer import CacheWriter
from deepspec.cli import main
from tests.cache.test_conformance import expect_equal, files, make_part, manifest, where, write  # noqa: F401


def test_gc_lists_then_deletes_only_what_no_kept_manifest_lists(where, tmp_path, capsys):
    kind, url, options = where
    parts = [make_part("p000000", 1), make_part("p000001", 2)]
    write(where, parts)
    extra = make_part("p000002", 3)
    w = CacheWriter(url, manifest(kind), options)
    w.submit(extra)
    w.close(consolidate=False)  # committed, never listed: what a build cut short (or an old input) leaves
    w.release()
    report = verify(url, options)
    assert report["ok"] and report["unlisted_parts"] == 1 and report["unlisted_example"] == ["p000002"]

    # a workspace whose manifest lists the extra part keeps it
    kept = dict(CacheReader(url, options).manifest, url=url)
    kept["parts"] = kept["parts"] + [{"name": "p000002", "samples": 3, "tokens": int(extra.lengths.sum())}]
    kept.pop("index")
    (tmp_path / "kept.json").write_text(json.dumps(kept))
    assert collect(url, [str(tmp_path / "kept.json")], options)["unlisted_parts"] == []

    before = files(url, options)
    dry = collect(url, [], options)
    assert dry["unlisted_parts"] == ["p000002"] and not dry["deleted"] and files(url, options) == before

    holder = acquire(url, options)  # a cache stage writing this store: gc waits its turn
    with pytest.raises(CacheFormatError, match="another job is writing"):
        collect(url, [], options, delete=True)
    holder.release()

    args = ["cache", "gc", url, "--delete"] + (["--storage-options", json.dumps(options)] if options else [])
    assert main(args) == 0
    assert json.loads(capsys.readouterr().out)["unlisted_parts"] == ["p000002"]
    after = verify(url, options)
    assert after["ok"] and after["unlisted_parts"] == 0
    assert not any("p000002" in k for k in files(url, options))
    expect_equal(CacheReader(url, options), parts)


def test_a_kept_manifest_of_another_store_is_refused(where, tmp_path):
    kind, url, options = where
    write(where, [make_part("p000000", 1)])
    other = dict(CacheReader(url, options).manifest, url=url + "-elsewhere")
    (tmp_path / "other.json").write_text(json.dumps(other))
    with pytest.raises(CacheFormatError, match="not of"):
        collect(url, [str(tmp_path / "other.json")], options)
