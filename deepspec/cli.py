"""`deepspec ...`: tools usable outside DVC: cache info|verify|ls|estimate|derive and reference-format
import/export, export, serve."""
from __future__ import annotations

import argparse
import json
import sys

from deepspec.cache.spec.format import CacheFormatError
from deepspec.config import CacheConfig


def _storage_options(text: str | None) -> dict | None:
    return json.loads(text) if text else None


def _parse_layers(text: str) -> list[int]:
    return [int(x) for x in text.replace("[", "").replace("]", "").split(",") if x.strip()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="deepspec", description=__doc__)
    sub = parser.add_subparsers(dest="group", required=True)
    cache = sub.add_parser("cache", help="inspect, check and size target caches")
    cmds = cache.add_subparsers(dest="cmd", required=True)
    for name, text in (("info", "counts, layers, dtype, bytes/token, target identity"),
                       ("verify", "read every chunk; check checksums, offsets and counts"),
                       ("ls", "the stores in a lake (a remote cache.url): layers, dtype, codec, counts")):
        p = cmds.add_parser(name, help=text)
        p.add_argument("url", help="s3://bucket/lake" if name == "ls" else "store path or s3://bucket/path")
        p.add_argument("--storage-options", help="JSON dict passed to fsspec (e.g. endpoint_url)")
        if name == "verify":
            p.add_argument("--recompute", type=int, default=0, metavar="N",
                           help="also run the target on N random samples and compare every cached layer")
            p.add_argument("--target", help="the target model directory (with --recompute)")
    gc = cmds.add_parser("gc", help="the parts of a store no kept manifest lists (dry run; --delete removes them)")
    gc.add_argument("url", help="store path or s3://bucket/path")
    gc.add_argument("--keep", nargs="*", default=[], metavar="MANIFEST",
                    help="manifests whose parts stay (e.g. data/cache/manifest.json of each workspace); the "
                         "store's own root is always kept")
    gc.add_argument("--delete", action="store_true", help="delete them (under the store's lease)")
    gc.add_argument("--wait", type=float, default=600.0, metavar="SECONDS",
                    help="with --delete: how long to wait for the lease while a cache stage holds it (0: fail at "
                         "once)")
    gc.add_argument("--storage-options", help="JSON dict passed to fsspec (e.g. endpoint_url)")
    defaults = CacheConfig()
    est = cmds.add_parser("estimate", help="bytes/token and total size for a target shape; with --config the "
                                           "cache stage's memory per GPU at each --tensor-parallel k")
    est.add_argument("--hidden-size", type=int, help="the target's width (without --config)")
    est.add_argument("--layers", type=_parse_layers, required=True, help="e.g. 1,9,17,25,33")
    est.add_argument("--tokens", type=float, help="total tokens (e.g. 1.25e9): the store's size")
    est.add_argument("--dtype", choices=["bfloat16", "fp8"], default="bfloat16", help="the store's (cache.dtype)")
    est.add_argument("--config", help="a model directory or its config.json (read offline): per-GPU memory")
    est.add_argument("--tensor-parallel", type=_parse_layers, default=[1], metavar="K,...",
                     help="ranks the target is sharded over (cache.tensor_parallel), e.g. 1,2,4,8")
    est.add_argument("--batch-tokens", type=int, default=defaults.batch_tokens, help="cache.batch_tokens")
    est.add_argument("--max-length", type=int, default=defaults.max_length, help="cache.max_length")
    est.add_argument("--weights-dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16",
                     help="the target's weights and activations (bfloat16 on a GPU)")
    est.add_argument("--overhead-gib", type=float, default=2.0,
                     help="CUDA context, cuBLAS/NCCL workspaces and allocator slack, per GPU (an assumption)")
    est.add_argument("--markdown", action="store_true", help="with --config: the table rows docs/scale.md shows")
    imp = cmds.add_parser("import-reference", help="a reference (DeepSpec) target cache directory -> a new store")
    imp.add_argument("dir", help="reference cache directory (manifest.json, samples.idx, shard-*.bin)")
    imp.add_argument("dst", help="new store path or s3://bucket/path")
    imp.add_argument("--target", help="target model directory with identity.json (the model the cache was "
                                      "computed with); without it the store's target identity is unknown "
                                      "and training refuses it, unless the cache was exported from here")
    imp.add_argument("--codec", choices=["none", "blosc-zstd", "blosc-lz4"], default=defaults.codec)
    imp.add_argument("--chunk-tokens", type=int, default=defaults.chunk_tokens)
    imp.add_argument("--part-tokens", type=int, default=defaults.part_tokens)
    imp.add_argument("--format", dest="storage", choices=["zarr", "hdf5"], default=defaults.format,
                     help="backend of the new store")
    imp.add_argument("--storage-options", help="JSON dict passed to fsspec (e.g. endpoint_url)")
    conv = cmds.add_parser("convert", help="a store -> the same store in another backend (zarr <-> hdf5)")
    conv.add_argument("src", help="store path or s3://bucket/path")
    conv.add_argument("dst", help="new store path or s3://bucket/path")
    conv.add_argument("--format", dest="storage", choices=["zarr", "hdf5"],
                      help="backend of the new store (default: the other one)")
    conv.add_argument("--codec", choices=["none", "blosc-zstd", "blosc-lz4"], help="default: the source's")
    conv.add_argument("--storage-options", help="JSON dict passed to fsspec (e.g. endpoint_url)")
    exp = cmds.add_parser("export-reference", help="a store -> a reference (DeepSpec) target cache directory")
    exp.add_argument("src", help="store path or s3://bucket/path")
    exp.add_argument("dir", help="new local directory")
    exp.add_argument("--layers", type=_parse_layers, help="subset of the cached layers (default: all)")
    exp.add_argument("--target-name", help="the reference config's model.target_model_name_or_path "
                                           "(its trainer requires the manifest to match it)")
    exp.add_argument("--shard-bytes", type=int, default=64 * 2**30, help="roll to a new shard file past this size")
    exp.add_argument("--storage-options", help="JSON dict passed to fsspec (e.g. endpoint_url)")
    der = cmds.add_parser("derive", help="a store with a subset of the layers and/or fp8 values / another codec, "
                                         "from an existing store without the target (links or re-encodes parts)")
    der.add_argument("src", help="store path or s3://bucket/path")
    der.add_argument("dst", help="new store path or s3://bucket/path (rerun to resume an interrupted derive)")
    der.add_argument("--layers", type=_parse_layers, help="subset of the source's layers (default: all)")
    der.add_argument("--dtype", choices=["bfloat16", "fp8"], help="default: the source's")
    der.add_argument("--codec", choices=["none", "blosc-zstd", "blosc-lz4"], help="default: the source's")
    der.add_argument("--chunk-tokens", type=int, help="default: the source's")
    der.add_argument("--storage-options", help="JSON dict passed to fsspec (e.g. endpoint_url)")
    serve = sub.add_parser("serve", help="launch inference servers for the regen stage (GPU)")
    serve_cmds = serve.add_subparsers(dest="cmd", required=True)
    sg = serve_cmds.add_parser("sglang", help="one sglang server per GPU, and the sglang router in front")
    sg.add_argument("--model", default="data/target", help="model directory or hub id")
    sg.add_argument("--gpus", type=int, required=True, help="number of servers (one per GPU)")
    sg.add_argument("--no-router", action="store_true", help="do not start the sglang router")
    sg.add_argument("--print-only", action="store_true", help="print the commands instead of running them")
    sg.add_argument("--log-dir", default="data/regen/logs")
    ex = sub.add_parser("export", help="write a trained draft as model dirs serving engines load (docs/export.md)")
    ex.add_argument("draft_dir", help="a deepspec draft directory (e.g. data/draft)")
    ex.add_argument("--format", dest="formats", action="append", required=True,
                    help="speculators | dflash | sglang-eagle3 (repeat for several)")
    ex.add_argument("--out", required=True, help="writes OUT/<format>/ per format and OUT/report.json")
    ex.add_argument("--target", default="data/target", help="the target model directory the draft was trained on")
    ex.add_argument("--verifier", default="",
                    help="how the exported config names the target (default: for data/target the hub id when "
                         "params.yaml's target.source is hf:..., else --target)")
    ex.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    ex.add_argument("--overwrite", action="store_true", help="replace OUT/<format>/ if it exists")
    args = parser.parse_args(argv)

    if args.group == "serve":
        return _serve_sglang(args)
    if args.group == "export":
        return _export(args)

    from deepspec.cache.tools import estimate, reference, verify

    try:
        if args.cmd == "info":
            out = verify.info(args.url, _storage_options(args.storage_options))
        elif args.cmd == "verify":
            out = verify.verify(args.url, _storage_options(args.storage_options))
            if args.recompute:
                if not args.target:
                    raise CacheFormatError("--recompute needs --target DIR (the target model directory)")
                out["recompute"] = verify.recompute(args.url, args.target, args.recompute,
                                                    _storage_options(args.storage_options))
                if not out["recompute"]["ok"]:
                    print(json.dumps(out, indent=2))
                    return 1
        elif args.cmd == "gc":
            from deepspec.cache.tools.gc import collect

            out = collect(args.url, args.keep, _storage_options(args.storage_options), args.delete, args.wait)
        elif args.cmd == "ls":
            from deepspec.cache.storage.naming import list_stores

            out = list_stores(args.url, _storage_options(args.storage_options))
        elif args.cmd == "import-reference":
            out = reference.import_reference(args.dir, args.dst, args.target, args.codec, args.chunk_tokens,
                                             args.part_tokens, defaults.shard_bytes,
                                             _storage_options(args.storage_options), args.storage)
        elif args.cmd == "convert":
            from deepspec.cache.tools.convert import convert

            out = convert(args.src, args.dst, args.storage, args.codec,
                          storage_options=_storage_options(args.storage_options))
        elif args.cmd == "derive":
            from deepspec.cache.build.derive import derive_store

            out = derive_store(args.src, args.dst, args.layers, args.dtype, args.codec, args.chunk_tokens,
                               _storage_options(args.storage_options))
        elif args.cmd == "export-reference":
            out = reference.export_reference(args.src, args.dir, args.layers, args.target_name, args.shard_bytes,
                                             _storage_options(args.storage_options))
        elif args.config:
            try:
                out = estimate.estimate_memory(args.config, args.tensor_parallel, args.layers, args.batch_tokens,
                                               args.weights_dtype, args.dtype, args.max_length, args.overhead_gib)
            except (OSError, ValueError) as e:       # no such config, an unknown model_type, a layer out of range
                print(f"error: {e}", file=sys.stderr)
                return 1
            for row in out["tensor_parallel"]:
                if row["refused"]:
                    print(f"refused: {row['refused']}", file=sys.stderr)
            if args.tokens:
                out["store"] = estimate.estimate(out["shape"]["hidden"], args.layers, int(args.tokens), args.dtype)
            if args.markdown:
                print("\n".join(estimate.markdown_rows(out)))
                return 0
        else:
            if args.hidden_size is None or args.tokens is None:
                parser.error("cache estimate needs --hidden-size and --tokens, or --config")
            out = estimate.estimate(args.hidden_size, args.layers, int(args.tokens), args.dtype)
    except CacheFormatError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(json.dumps(out, indent=2))
    return 0


def _export(args) -> int:
    from pathlib import Path

    from deepspec.config import ConfigError
    from deepspec.params import load_params
    from deepspec.export import ExportError, export_draft, verifier_reference

    target = Path(args.target)
    source = ""
    # the project's own target (data/target) is named as the pipeline names it: by hub id when hf:
    if not args.verifier and args.target == "data/target" and Path("params.yaml").exists():
        try:
            source = load_params("params.yaml").target.source
        except ConfigError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
    try:
        report = export_draft(Path(args.draft_dir), Path(args.out), args.formats, target,
                              verifier_reference(source, target, args.verifier), args.dtype, args.overwrite)
    except ExportError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(json.dumps(report["formats"], indent=2))
    return 0


def _serve_sglang(args) -> int:
    from pathlib import Path

    from deepspec.data.servers import ServerError, launch_sglang, sglang_commands

    if args.print_only:
        plan = sglang_commands(args.model, args.gpus)
        for s in plan["servers"]:
            env = " ".join(f"{k}={v}" for k, v in s["env"].items())
            print(f"{env} {' '.join(s['cmd'])} &")
        if not args.no_router:
            print(" ".join(plan["router"]["cmd"]))
        return 0
    try:
        endpoints, started = launch_sglang(args.model, args.gpus, Path(args.log_dir), use_router=not args.no_router)
    except ServerError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(json.dumps({"regen.urls": [e.url for e in endpoints]}), flush=True)
    try:
        started[0].proc.wait()
    except KeyboardInterrupt:
        pass
    finally:
        for s in reversed(started):
            s.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
