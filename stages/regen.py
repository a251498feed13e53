"""DVC stage `regen`: data/split/train.jsonl -> data/regen/{train,errors}.jsonl (see deepspec.data.regen)."""
import itertools
import json
import logging
import os
from pathlib import Path

from deepspec.data.chat_client import Endpoint, ProbeError, ProbeRejected, probe_endpoints
from deepspec.data.journal import Journal, JournalError
from deepspec.data.regen import (SplitRows, model_eos, regen_fingerprint, reproducibility, request_token_bound,
                                 run_regen, write_outputs)
from deepspec.data.generate import run_local
from deepspec.data.servers import ServerError, cb_budget, launch_sglang, launch_transformers_serve
from deepspec.io import write_json
from deepspec.devices import local_device
from deepspec.models.target import compute_dtype, load_causal_lm, load_identity
from deepspec.stage import StageError, run_stage

log = logging.getLogger("regen")
OUT = Path("data/regen")
TARGET = Path("data/target")


def kv_budget(cfg, sampling, rows):
    """The continuous-batching KV cache for `cfg.concurrency` requests of the longest of these rows."""
    from transformers import AutoTokenizer

    need = request_token_bound(AutoTokenizer.from_pretrained(TARGET), rows, sampling, cfg.disable_thinking)
    budget = cb_budget(need, cfg.concurrency)
    log.info("KV cache for %d requests of up to %d tokens: %s", cfg.concurrency, need, budget)
    return budget


def start_endpoints(cfg, sampling, rows, stack):
    """Endpoints to send requests to; servers this stage starts are pushed on `stack` to be stopped."""
    model = cfg.model or str(TARGET)
    if cfg.urls:
        return [Endpoint(u.rstrip("/").removesuffix("/v1"), model) for u in cfg.urls]
    if cfg.backend == "transformers":
        batching = cfg.concurrency > 1
        server = launch_transformers_serve(TARGET, cfg.server_port, continuous_batching=batching,
                                           log_dir=OUT / "logs", timeout=cfg.server_start_timeout_s,
                                           cb=kv_budget(cfg, sampling, rows) if batching else None)
        stack.append(server)
        return [Endpoint(server.url, server.model)]
    if cfg.backend == "sglang" and cfg.launch_servers > 0:
        endpoints, started = launch_sglang(str(TARGET), cfg.launch_servers, OUT / "logs",
                                           cfg.server_start_timeout_s, deterministic=cfg.deterministic)
        stack.extend(started)
        return [Endpoint(s.url, model) for s in endpoints]
    raise StageError(f"regen.urls: backend {cfg.backend!r} needs server URLs (or regen.launch_servers for sglang)")


def main(params):
    cfg = params.regen
    rows = SplitRows(Path("data/split/train.jsonl"), cfg)  # read as needed, never held whole
    n_rows = sum(1 for _ in rows)
    if not n_rows:
        raise StageError("regen: data/split/train.jsonl has no rows to regenerate (the split stage's "
                         "output; check split.source and data/split/report.json)")
    identity = load_identity(TARGET)
    device = local_device()  # regen.backend local runs the target on this process's accelerator
    # what the local backend's floats depend on beyond the target (whose identity covers its attention kernel)
    compute = {"dtype": compute_dtype(device)} if cfg.backend == "local" else None
    try:
        journal = Journal(OUT / "journal", regen_fingerprint(cfg, params.sampling, identity, compute))
    except JournalError as e:
        raise StageError(str(e)) from None
    try:
        if cfg.backend == "local":
            ordered, errors = run_local(rows, TARGET, cfg, params.sampling, journal,
                                        lambda dev: load_causal_lm(TARGET, dev), model_eos(TARGET), device)
        else:
            ordered, errors = through_servers(cfg, params.sampling, rows, journal)
        finish(cfg, params, n_rows, ordered, errors, identity)  # reads the finished rows back from the journal
    finally:
        journal.close()


def through_servers(cfg, sampling, rows, journal):
    """run_regen against the servers of `cfg` (started here if it says so, and stopped again)."""
    api_key = os.environ.get(cfg.api_key_env) if cfg.backend == "openai" else None
    servers = []
    try:
        todo = (r for r in rows if r["id"] not in journal.done)
        first = next(todo, None)
        endpoints = start_endpoints(cfg, sampling, itertools.chain([first], todo), servers) \
            if first is not None else []
        eos = model_eos(TARGET) if cfg.backend == "transformers" else None
        if endpoints:
            endpoints = probe_endpoints(endpoints, cfg, sampling, api_key, eos)
        return run_regen(rows, endpoints, cfg, sampling, journal, api_key, eos)
    except (ServerError, ProbeError, ProbeRejected) as e:
        raise StageError(str(e)) from None
    finally:
        for s in reversed(servers):
            s.stop()


def finish(cfg, params, n_rows, ordered, errors, identity):
    write_outputs(OUT, ordered, errors, params.sampling, identity["id"])
    summary = {"rows": n_rows, "regenerated": len(ordered), "errors": len(errors),
               **reproducibility(cfg, params.sampling)}
    write_json(OUT / "report.json", summary)
    print(json.dumps(summary))
    if n_rows and len(errors) / n_rows > cfg.max_error_fraction:
        raise StageError(f"regen: {len(errors)} of {n_rows} samples failed (> regen.max_error_fraction "
                         f"{cfg.max_error_fraction}); see {OUT / 'errors.jsonl'}; rerun to retry them")


if __name__ == "__main__":
    run_stage(main)
