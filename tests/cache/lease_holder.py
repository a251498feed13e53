"""A second process for the lease tests: open a CacheWriter (or only its lease) on a store, report,
then hold it, write parts, or wait for a start signal — as one writer of a pair would.

    python -m tests.cache.lease_holder '{"url": ..., "storage_options": {...}, "ttl": 3, ...}'

Prints one JSON line per event on stdout ({"event": "held", "run_id": ..., "pid": ...},
{"event": "refused", "error": ...}, {"event": "wrote", ...}, {"event": "failed", "error": ...}).
"""
import json
import os
import sys
import time


def say(**event):
    print(json.dumps(event), flush=True)


def part(name: str, seed: int):
    import numpy as np
    import torch

    from deepspec.cache.write.part_data import PartData

    g = torch.Generator().manual_seed(seed)
    lengths = np.array([5, 7], dtype=np.int64)
    return PartData(name, np.array([seed * 10 + 1, seed * 10 + 2], dtype=np.uint64), lengths,
                    np.arange(12, dtype=np.int32), np.ones(12, dtype=np.uint8),
                    {k: torch.randn(12, 8, generator=g) for k in (0, "last")})


MANIFEST = {"target": {"id": "t", "hidden_size": 8}, "layers": [0], "dtype": "bfloat16", "codec": "none",
            "max_length": 64, "chunk_tokens": 4, "hidden_size": 8}


def main(spec: dict) -> int:
    from deepspec.cache.spec.format import CacheFormatError
    from deepspec.cache.write.lease import acquire
    from deepspec.cache.write.writer import CacheWriter

    if "start_at" in spec:  # start at one wall-clock instant with the other process
        time.sleep(max(0.0, spec["start_at"] - time.time()))
    try:
        if spec.get("lease_only"):
            lease = acquire(spec["url"], spec.get("storage_options"), spec.get("run_id"), ttl=spec["ttl"],
                            host=spec.get("host"))
            writer = None
            run_id = lease.run_id
        else:
            writer = CacheWriter(spec["url"], MANIFEST, spec.get("storage_options"), lease_ttl=spec["ttl"])
            run_id = writer.lease.run_id
    except CacheFormatError as e:
        say(event="refused", error=str(e))
        return 3
    say(event="held", run_id=run_id, pid=os.getpid())
    for line in sys.stdin:  # commands from the test, one per line
        cmd = json.loads(line)
        if cmd["do"] == "write":
            try:
                writer.write_part(part(cmd["part"], cmd["seed"]))
                say(event="wrote", part=cmd["part"])
            except CacheFormatError as e:
                say(event="failed", error=str(e))
        elif cmd["do"] == "release":
            (writer.release if writer else lease.release)()
            say(event="released")
        elif cmd["do"] == "exit":
            break
    return 0


if __name__ == "__main__":
    sys.exit(main(json.loads(sys.argv[1])))
