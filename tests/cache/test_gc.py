"""`deepspec cache gc` and `verify`'s unlisted parts, on every backend (docs/cache-format.md §7)."""
import json
import logging
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from deepspec.cache.spec.format import CacheFormatError
from deepspec.cache.tools.gc import collect
from deepspec.cache.write.lease import acquire
from deepspec.cache.read.reader import CacheReader
from deepspec.cache.tools.verify import verify
from deepspec.cache.write.writer import CacheWriter
from deepspec.cli import main
from tests.cache.test_conformance import expect_equal, files, make_part, manifest, where, write  # noqa: F401
from tests.conftest import REPO, project_env


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


# A cache stage in another process: holds the store's lease, and once told (gc is waiting for that
# lease) commits a part and switches the root to list it, then releases.
WRITER = """
import json, sys
from deepspec.cache.write.writer import CacheWriter
from tests.cache.test_conformance import make_part, manifest
spec = json.loads(sys.argv[1])
w = CacheWriter(spec["url"], manifest(spec["kind"]), spec["options"])
print("held", flush=True)
sys.stdin.readline()
w.submit(make_part("p000002", 3))
w.close(order=["p000000", "p000001", "p000002"])
w.release()
print("released", flush=True)
"""


class _Waiting(logging.Handler):
    """Set once the lease module says this process waits for the lease."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.seen = threading.Event()

    def emit(self, record: logging.LogRecord) -> None:
        if "waiting up to" in record.getMessage():
            self.seen.set()


def test_gc_waits_for_a_writing_cache_stage_and_keeps_what_its_new_root_lists(where):
    kind, url, options = where
    parts = [make_part("p000000", 1), make_part("p000001", 2)]
    write(where, parts)
    w = CacheWriter(url, manifest(kind), options)
    w.submit(make_part("p000009", 9))
    w.close(consolidate=False)  # committed, never listed: what gc is for
    w.release()

    spec = json.dumps({"url": url, "kind": kind, "options": options})
    writer = subprocess.Popen([sys.executable, "-c", WRITER, spec], cwd=REPO, env=project_env(REPO),
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    waiting = _Waiting()
    lease_log = logging.getLogger("deepspec.cache.write.lease")
    lease_log.addHandler(waiting)
    try:
        assert writer.stdout.readline().strip() == "held"
        with ThreadPoolExecutor(1) as pool:
            gc = pool.submit(collect, url, [], options, True, 120)
            while not waiting.seen.wait(0.1):
                if gc.done():
                    gc.result()  # raises what stopped it
                    pytest.fail("gc went on while a cache stage held the store's lease")
            writer.stdin.write("go\n")  # the stage commits and switches the root while gc waits
            writer.stdin.flush()
            assert writer.stdout.readline().strip() == "released"
            result = gc.result(120)
    finally:
        lease_log.removeHandler(waiting)
        if writer.poll() is None:
            writer.kill()
        writer.wait()
    listed = [p["name"] for p in CacheReader(url, options).manifest["parts"]]
    assert listed == ["p000000", "p000001", "p000002"]
    assert result["deleted"] and not set(result["unlisted_parts"]) & set(listed)
    assert result["listed_but_missing"] == []
    stored = files(url, options)
    assert not any("p000009" in k for k in stored)  # gc (on S3; on local disk the stage) still reclaims
    assert all(any(f"parts/{name}" in k for k in stored) for name in listed)
    expect_equal(CacheReader(url, options), parts + [make_part("p000002", 3)])
