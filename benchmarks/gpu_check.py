"""The prepared GPU check: the CUDA path of cache, train and eval, end to end, in one command.

    make gpu-check                    # on a GPU machine (installs .gpu-wheels first, see the Makefile)
    make gpu-check CPU=1              # the same script on the CPU, small sizes (part of `make test`)
    python benchmarks/gpu_check.py [--cpu] [--out DIR]

Two targets: the shipped `builtin:tiny` (materialised from embedded/, DVC's remote in the repo, by
dvc.lock's hash) and a randomly initialised target of Qwen3-4B's width and vocabulary (H 2,560,
V 151,936, a few layers, bf16 on CUDA; made from its config on the device, since no model file
travels with the repository). For each target:
- cache: `build_cache` on the device; the stored states equal the model's own `output_hidden_states`
  over the same padded batches within bf16 rounding (on CUDA, where the model runs in bf16: exactly);
  capture tokens/s (forward + hooks + encode + pinned copies on the copy stream, waited for) against
  a plain forward over the same batches;
- train: steps of the real loader + prefetcher (`train.num_workers` workers) against the same
  micro-batches already on the device: tokens/s ratio and the share of step time spent waiting for data;
- eval: greedy speculative decoding equals plain greedy decoding token for token (reported in the
  stage's dtype, bf16 on CUDA, where a near-tied argmax can flip between a block's verify forward and a
  one-token forward; asserted for the trained tiny target in float32 on CUDA, in the stage's float32 on
  the CPU), and
  sampled decoding's τ, both on the device with generators on the device;
- peak CUDA memory of each section.
Then the multi-process part one GPU allows: the cache stage under `torchrun --nproc-per-node 2` over
gloo (CUDA hidden) derives a layer subset with no target forward. It cannot show NCCL collectives
across GPUs, the LOCAL_RANK -> GPU mapping beyond GPU 0, or DDP over NCCL: those need two GPUs.

Prints one table, writes the same as JSON to `--out DIR/gpu_check.json`, and exits 1 when a check fails.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

SIZES = {  # per mode: what one H200 shows in minutes, and what 2 CPU cores run inside `make test`
    "cuda": {"tiny_rows": 512, "wide_rows": 384, "wide": dict(hidden_size=2560, intermediate_size=9728,
                                                              num_attention_heads=32, num_key_value_heads=8,
                                                              head_dim=128, num_hidden_layers=4),
             "batch_tokens": 65536, "train": dict(batch_size=8, grad_accum=2, anchors_per_sample=128, block_size=7,
                                                  markov_rank=256, num_workers=4), "steps": 12, "prompts": 8,
             "new_tokens": 64},
    "cpu": {"tiny_rows": 16, "wide_rows": 24, "wide": dict(hidden_size=64, intermediate_size=192, num_attention_heads=2,
                                                          num_key_value_heads=1, head_dim=32, num_hidden_layers=4,
                                                          vocab_size=16384),
            "batch_tokens": 4096, "train": dict(batch_size=4, grad_accum=2, anchors_per_sample=8, block_size=4,
                                                markov_rank=16, num_workers=1), "steps": 3, "prompts": 2,
            "new_tokens": 12},
}
QWEN3_4B = dict(vocab_size=151936, max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6,
                tie_word_embeddings=True)


# ---- targets ---------------------------------------------------------------------------------------

def shipped_target(dest: Path) -> Path:
    """builtin:tiny as dvc.lock records it, copied out of the repo's DVC remote (embedded/): the
    `.dir` object lists every file by its md5."""
    import yaml

    lock = yaml.safe_load((REPO / "dvc.lock").read_text())
    out = next(o for o in lock["stages"]["target"]["outs"] if o["path"] == "data/target")
    def obj(md5: str) -> Path:
        return REPO / "embedded" / "files" / "md5" / md5[:2] / md5[2:]
    for entry in json.loads(obj(out["md5"]).read_text()):
        (dest / entry["relpath"]).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(obj(entry["md5"]), dest / entry["relpath"])
    return dest


def wide_target(dest: Path, tokenizer_dir: Path, dims: dict, device: torch.device) -> Path:
    """A random Qwen3 of Qwen3-4B's width and vocabulary (fewer layers), with the tiny target's
    tokenizer and chat template (its ids are a subset of the vocabulary), as a model directory."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from deepspec.models.target import identity

    dest.mkdir(parents=True)
    for f in tokenizer_dir.iterdir():
        if f.is_file() and f.name not in ("config.json", "model.safetensors", "identity.json", "metrics.json"):
            shutil.copyfile(f, dest / f.name)
    config = Qwen3Config(**dict(QWEN3_4B, **dims))
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen3ForCausalLM(config).to(torch.bfloat16)
    model.generation_config.eos_token_id = json.loads((tokenizer_dir / "generation_config.json").read_text()).get(
        "eos_token_id") if (tokenizer_dir / "generation_config.json").exists() else None
    model.save_pretrained(dest)
    del model
    (dest / "identity.json").write_text(json.dumps(identity(dest)))
    return dest


def conversations(n: int, seed: int) -> list[dict]:
    """Regen rows of arithmetic and short instructions (what the tiny target was trained on), of 1 to
    12 turns, so lengths spread from tens to hundreds of tokens."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        turns = []
        for _ in range(rng.randint(1, 12)):
            a, b = rng.randint(2, 999), rng.randint(2, 999)
            turns += [{"role": "user", "content": f"What is {a} + {b}?"},
                      {"role": "assistant", "content": f"{a} + {b} = {a + b}."}]
        rows.append({"id": f"{rng.getrandbits(64):016x}", "conversations": turns})
    return rows


# ---- what the training benchmarks share ------------------------------------------------------------

DRAFT_KEYS = ("block_size", "draft_layers", "markov_rank", "anchors_per_sample", "batch_size", "grad_accum", "lr",
              "warmup_steps")


def default_train(*extra: str) -> dict:
    """params.yaml's train settings that shape the draft and its batches (the embedded default's), and `extra`."""
    from deepspec.params import load_params

    defaults = load_params(REPO / "params.yaml").train
    return {k: getattr(defaults, k) for k in (*DRAFT_KEYS, *extra)}


def cached(work: Path, target: Path, rows: int, seed: int, device: torch.device, layers: list[int], **cache) -> Path:
    """`rows` conversations at work/regen.jsonl and `target`'s cache of them at work/cache.zarr (`cache`:
    CacheConfig settings; default the device's batch size); returns `work`."""
    from deepspec.cache.build.stage import build_cache
    from deepspec.config import CacheConfig

    work.mkdir(parents=True, exist_ok=True)
    regen = work / "regen.jsonl"
    regen.write_text("".join(json.dumps(r) + "\n" for r in conversations(rows, seed=seed)))
    cache.setdefault("batch_tokens", SIZES[device.type]["batch_tokens"])
    build_cache(CacheConfig(url=str(work / "cache.zarr"), **cache), layers, regen, target, device=device)
    return work


def tiny_store(work: Path, rows: int, seed: int, device: torch.device, layers: list[int], **cache) -> Path:
    """builtin:tiny at work/tiny and its cache of `rows` conversations (`cached`); returns the target."""
    tiny = shipped_target(work / "tiny")
    cached(work, tiny, rows, seed, device, layers, **cache)
    return tiny


def eagle3_layers(layers: list[int]) -> list[int]:
    """EAGLE-3's three of `layers`: the lowest, the middle and the highest."""
    ordered = sorted(layers)
    return [ordered[0], ordered[len(ordered) // 2], ordered[-1]]


def resident(trainer, micro_batches: int) -> list[dict]:
    """The next `micro_batches` batches of the trainer's own loader, kept (on its device)."""
    source = trainer.batches()
    return [next(source) for _ in range(micro_batches)]


# ---- sections --------------------------------------------------------------------------------------

class Clock:
    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def now(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter()


def peak_reset(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(device)


def peak_gib(device: torch.device) -> float | None:
    return round(torch.cuda.max_memory_allocated(device) / 2**30, 2) if device.type == "cuda" else None


def check_cache(work: Path, target: Path, layers: list[int], rows: list[dict], size: dict, device: torch.device) -> dict:
    """build_cache on the device; stored states vs output_hidden_states; capture vs plain forward."""
    from deepspec.cache.build.stage import build_cache, forward_batches, length_batches, load_target, padded
    from deepspec.cache.read.reader import CacheReader
    from deepspec.cache.spec.format import decode_hidden
    from deepspec.cache.build.regen_rows import EncodeRules, encode_rows
    from deepspec.config import CacheConfig
    from deepspec.devices import landed

    regen = work / "regen.jsonl"
    regen.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = CacheConfig(url=str(work / "cache.zarr"), batch_tokens=size["batch_tokens"], max_length=1024)
    clock = Clock(device)
    peak_reset(device)
    t0 = clock.now()
    report = build_cache(cfg, layers, regen, target, device=device)
    build_s = clock.now() - t0
    out = {"samples": report["samples"], "tokens": int(report["manifest"]["num_tokens"]),
           "build_tokens_per_s": round(report["manifest"]["num_tokens"] / build_s), "build_peak_gib": peak_gib(device)}

    tokenizer, model = load_target(target, device)
    samples, _ = encode_rows(tokenizer, rows, EncodeRules.of(cfg))
    samples.sort(key=lambda s: -len(s.input_ids))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    tokens = sum(len(s.input_ids) for s in samples)

    def capture():  # every host copy landed, each waited for while the next batches compute (as the writer does)
        for _ in landed(forward_batches(model, samples, layers, size["batch_tokens"], pad, device)):
            pass

    @torch.no_grad()
    def plain():  # the same batches, padded and copied the same way, with no hooks, encoding or copies back
        base = model.get_decoder()
        for batch in length_batches(samples, size["batch_tokens"]):
            ids, mask, _ = padded(samples, batch, pad, pin=device.type == "cuda")
            base(input_ids=ids.to(device, non_blocking=True), attention_mask=mask.to(device, non_blocking=True),
                 use_cache=False)

    times = {}
    peak_reset(device)
    for name, fn in (("plain", plain), ("capture", capture), ("plain", plain), ("capture", capture)):
        t0 = clock.now()  # the second round of each is kept (kernels and allocator warm)
        fn()
        times[name] = clock.now() - t0
    out["capture_tokens_per_s"] = round(tokens / times["capture"])
    out["plain_tokens_per_s"] = round(tokens / times["plain"])
    out["capture_vs_plain"] = round(times["plain"] / times["capture"], 3)
    out["capture_peak_gib"] = peak_gib(device)

    # the store against the model's own hidden states over the same padded batches: layer i is
    # hidden_states[i + 1], `last` the final one (after the final norm)
    reader = CacheReader(str(work / "cache.zarr"))
    by_id = {int(v): k for k, v in enumerate(reader.sample_ids())}
    worst, checked = 0.0, 0
    with torch.no_grad():
        for batch in length_batches(samples, size["batch_tokens"])[:2]:
            ids, mask, lengths = padded(samples, batch, pad)
            hs = model(input_ids=ids.to(device), attention_mask=mask.to(device), output_hidden_states=True).hidden_states
            for row, i in enumerate(batch[:8]):
                n, stored = lengths[row], reader.read(by_id[samples[i].sample_id])
                for key, want in [*((layer, hs[layer + 1]) for layer in layers), ("last", hs[-1])]:
                    got = decode_hidden(*stored[key], reader.dtype)
                    ref = want[row, :n].float().cpu()
                    # bf16 rounding of the reference: half an ulp of each value (2^-8 relative), plus the
                    # smallest normal for zeros
                    err = ((got.float() - ref).abs() / (ref.abs() * 2.0**-8 + 1e-30)).max().item()
                    worst = max(worst, err)
                checked += 1
    out["states_checked"] = checked
    out["states_max_err_in_bf16_halfulps"] = round(worst, 3)
    out["states_ok"] = worst <= 1.0
    del model
    return out


def warm_trainer(work: Path, target: Path, layers: list[int], size: dict, workers: int, device: torch.device):
    """A trainer over work/cache.zarr with `workers` loading processes, after one warm-up step (workers
    started, kernels chosen); returns it, its batch iterator, and the list that iterator appends
    each batch it yields to (emptied after the warm-up)."""
    from deepspec.config import TrainConfig
    from deepspec.train.run import build_trainer

    cfg = TrainConfig(**dict(size["train"], num_workers=workers), steps=10 ** 6, warmup_steps=1, lr=1e-3,
                      draft_layers=1)
    trainer = build_trainer(cfg, layers, str(work / "cache.zarr"), target, work / "train", work / f"state{workers}",
                            device=device)
    trainer.module.train()
    kept: list = []

    def keeping(it):
        for b in it:
            kept.append(b)
            yield b

    batches = keeping(trainer.batches())
    trainer.step(batches)
    kept.clear()
    return trainer, batches, kept


def check_train(work: Path, target: Path, layers: list[int], size: dict, device: torch.device) -> tuple[dict, Path]:
    """Steps with the real loader and prefetcher against the same micro-batches already on the device;
    and the share of step time spent waiting for data with `num_workers` loading processes (batch n+1
    loads while step n runs) against none (every batch loaded between steps)."""
    clock = Clock(device)
    steps, out = size["steps"], {}
    for workers in (size["train"]["num_workers"], 0):
        trainer, batches, kept = warm_trainer(work, target, layers, size, workers, device)
        peak_reset(device)
        tokens0, wait0 = trainer.state.tokens, trainer.data_wait_s
        t0 = clock.now()
        for _ in range(steps):
            metrics = trainer.step(batches)
        loader_s = clock.now() - t0
        tokens, wait = trainer.state.tokens - tokens0, trainer.data_wait_s - wait0
        if workers == 0:
            out["data_wait_fraction_no_workers"] = round(wait / loader_s, 4)
            break
        out.update({"steps": steps, "workers": workers, "micro_batches": len(kept), "tokens": tokens,
                    "final_loss": round(metrics["loss"], 4), "loader_tokens_per_s": round(tokens / loader_s),
                    "data_wait_fraction": round(wait / loader_s, 4), "loader_peak_gib": peak_gib(device)})
        resident = iter(list(kept))
        t0 = clock.now()
        for _ in range(steps):
            trainer.step(resident)
        resident_s = clock.now() - t0
        out["resident_tokens_per_s"] = round(tokens / resident_s)
        out["loader_vs_resident"] = round(resident_s / loader_s, 3)
        draft = work / "draft"
        trainer.model.save(draft)
        del trainer, kept, resident, batches
    return out, draft


def check_eval(target: Path, draft: Path, size: dict, device: torch.device, must_match: bool) -> dict:
    from deepspec.config import SamplingConfig
    from deepspec.data.template import encode_prompt
    from deepspec.evaluate.run import load_models, round_metrics
    from deepspec.evaluate.specdec import SpecDecoder, Warp

    tok, model, draft_model, stop = load_models(target, draft, device)
    dec = SpecDecoder(model, draft_model, stop, device)
    rng = random.Random(1)
    prompts = [encode_prompt(tok, [{"role": "user", "content": f"What is {rng.randint(2, 999)} + {rng.randint(2, 999)}?"}])
               for _ in range(size["prompts"])]
    # The first decode in a process pays CUDA's lazy start-up (kernel loading, cuBLAS handles), which
    # would dominate a tiny model's ms per token.
    dec.plain(prompts[0], 2, Warp(), seed=0)
    dec.speculative(prompts[0], 2, Warp(), seed=0)  # the draft's first forward pays its own start-up
    peak_reset(device)
    greedy, plain, sampled = [], [], []
    for k, ids in enumerate(prompts):
        plain.append(dec.plain(ids, size["new_tokens"], Warp(), seed=k))
        greedy.append(dec.speculative(ids, size["new_tokens"], Warp(), seed=k))
        sampled.append(dec.speculative(ids, size["new_tokens"], Warp.from_sampling(SamplingConfig(), greedy=False), seed=k))
    match = sum(g.tokens == p.tokens for g, p in zip(greedy, plain)) / len(prompts)
    block = draft_model.config.block_size
    out = {"prompts": len(prompts), "greedy_match": match, "tau_greedy": round_metrics(greedy, block)["tau"],
           "tau_sampled": round_metrics(sampled, block)["tau"],
           "speedup_greedy": round(sum(p.seconds for p in plain) / max(sum(g.seconds for g in greedy), 1e-9), 3),
           # what a decoding step costs the host and device together (devices.decoding's kernel order shows here)
           "plain_ms_per_token": round(1000 * sum(p.seconds for p in plain) / max(sum(len(p.tokens) for p in plain), 1), 2),
           "peak_gib": peak_gib(device), "greedy_match_required": must_match}
    if must_match and device.type == "cuda":
        # In bf16 a verify forward over a block and a one-token forward round differently, and the
        # argmax of a near-tie can flip (the eval stage reports greedy_match as measured). The
        # algorithm's check runs both in float32, where such flips are far below one in a run.
        model.float()
        draft_model.float()
        dec = SpecDecoder(model, draft_model, stop, device)
        match = sum(dec.speculative(ids, size["new_tokens"], Warp(), seed=k).tokens
                    == dec.plain(ids, size["new_tokens"], Warp(), seed=k).tokens
                    for k, ids in enumerate(prompts)) / len(prompts)
        out["greedy_match_fp32"] = match
    out["ok"] = match == 1.0 or not must_match
    return out


def check_torchrun_derive(work: Path, target: Path, rows: list[dict]) -> dict:
    """The cache stage under torchrun with 2 processes over gloo (CUDA hidden): a layer subset is
    derived by both ranks, no target forward."""
    import yaml

    from deepspec.data.servers import free_port

    (work / "data" / "regen").mkdir(parents=True)
    shutil.copytree(target, work / "data" / "target")
    (work / "data" / "regen" / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", DEEPSPEC_LOG="WARNING", PYTHONPATH=os.pathsep.join(
        [str(REPO), os.environ.get("PYTHONPATH", "")]))

    def run(layers, launcher):
        p = yaml.safe_load((REPO / "params.yaml").read_text())
        p["layers"] = layers
        # one torch thread in both runs: a CPU build's thread count is part of what its states are
        # computed with, and torchrun gives each rank one thread where a plain process takes every core
        p["cache"].update(part_tokens=2048, threads=1)
        (work / "params.yaml").write_text(yaml.safe_dump(p))
        proc = subprocess.run([*launcher, str(REPO / "stages" / "cache.py")], cwd=work, env=env, capture_output=True,
                              text=True, timeout=300)
        if proc.returncode:
            raise RuntimeError(f"{' '.join(launcher)} stages/cache.py failed:\n{proc.stderr[-3000:]}")
        return json.loads((work / "data" / "cache" / "report.json").read_text())

    t0 = time.perf_counter()
    run([1, 9, 17, 25, 33], [sys.executable])
    report = run([9, 25], [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                           "--master-port", str(free_port())])
    derive = report["derive"]
    return {"ranks": 2, "mode": report["mode"], "parts_derived": derive["parts_derived"],
            "parts_computed": derive["parts_computed"], "seconds": round(time.perf_counter() - t0, 1),
            "ok": report["mode"] == "derived" and derive["parts_computed"] == 0,
            "not_shown": "NCCL collectives across GPUs, LOCAL_RANK -> GPU beyond GPU 0, DDP over NCCL (one GPU)"}


# ---- the run ---------------------------------------------------------------------------------------

def table(results: dict) -> str:
    lines = []
    for section, values in results.items():
        if not isinstance(values, dict):
            lines.append(f"{section:<34} {values}")
            continue
        for key, value in values.items():
            lines.append(f"{section + '.' + key:<58} {value}")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cpu", action="store_true", help="run on the CPU at small sizes (what `make test` runs)")
    ap.add_argument("--out", type=Path, help="write gpu_check.json here")
    args = ap.parse_args()
    from deepspec.devices import local_device

    device = torch.device("cpu") if args.cpu else local_device()
    if device.type != "cuda" and not args.cpu:
        print("gpu_check: no CUDA device here; `make gpu-check CPU=1` runs the CPU version", file=sys.stderr)
        return 2
    size = SIZES[device.type]
    import transformers

    results: dict = {"env": {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                             "torch": torch.__version__, "cuda": torch.version.cuda,
                             "transformers": transformers.__version__, "python": sys.version.split()[0]}}
    failed = []
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        tmp = Path(tmp)
        tiny = shipped_target(tmp / "tiny")
        plans = [("tiny", lambda: tiny, [1, 9, 17, 25, 33], size["tiny_rows"], True),
                 ("wide", lambda: wide_target(tmp / "wide", tiny, size["wide"], device), [0, 1, 2], size["wide_rows"],
                  False)]
        for name, make, layers, n_rows, must_match in plans:
            work = tmp / f"work-{name}"
            work.mkdir()
            rows = conversations(n_rows, seed=len(name))
            for section, run in (("cache", lambda: check_cache(work, target, layers, rows, size, device)),
                                 ("train", lambda: check_train(work, target, layers, size, device)),
                                 ("eval", lambda: check_eval(target, draft, size, device, must_match))):
                key = f"{name}.{section}"
                t0 = time.perf_counter()
                try:
                    if section == "cache":
                        target = make()
                    value = run()
                    if section == "train":
                        value, draft = value
                    value["seconds"] = round(time.perf_counter() - t0, 1)
                except Exception:  # noqa: BLE001 - reported, and the check fails
                    value = {"error": traceback.format_exc()[-2000:]}
                results[key] = value
                if "error" in value or not value.get("ok", value.get("states_ok", True)):
                    failed.append(key)
                print(table({key: value}), flush=True)
                if "error" in value:
                    break  # later sections of this target need this one's output
            if device.type == "cuda":
                torch.cuda.empty_cache()
        try:
            results["torchrun"] = check_torchrun_derive(tmp / "torchrun", tiny, conversations(size["tiny_rows"], 7))
        except Exception:  # noqa: BLE001
            results["torchrun"] = {"error": traceback.format_exc()[-2000:]}
        if not results["torchrun"].get("ok"):
            failed.append("torchrun")
        print(table({"torchrun": results["torchrun"]}), flush=True)
    results["failed"] = failed
    print("\n" + table(results))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "gpu_check.json").write_text(json.dumps(results, indent=1))
    print(f"\ngpu_check: {'FAILED: ' + ', '.join(failed) if failed else 'every check passed'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
