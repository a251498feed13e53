"""Typed view of params.yaml.

Every section is a dataclass whose field types carry their bounds; `deepspec.params.load_params`
validates the file against them with pydantic (extra keys forbidden, no coercion of one type into
another), so an unknown key, a wrong type or an out-of-range value fails with the file, the key path
and the bad value before any stage does expensive work. Sections built in code
(`SamplingConfig(max_tokens=8)`) are plain dataclasses and are not validated.
"""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, Strict


class ConfigError(ValueError):
    pass


# YAML's types as they are written: `5` is not a float's "5.0" typo to fix up, "5" is not a number,
# `yes` is not true (an int is still accepted where a float is wanted)
Int = Annotated[int, Strict()]
Float = Annotated[float, Strict()]
Bool = Annotated[bool, Strict()]
Str = Annotated[str, Strict()]


def section(cls: type) -> type:
    """A params.yaml section: a dataclass in which a key that is not a field is an error."""
    cls.__pydantic_config__ = ConfigDict(extra="forbid")
    return dataclass(cls)


@section
class SplitConfig:
    source: Str = "builtin:chat"
    seed: Annotated[Int, Field(ge=0)] = 0
    test_fraction: Annotated[Float, Field(ge=0.0, lt=1.0)] = 0.05
    hf_split: Str = "train"
    # more rejected rows than this fraction of those read fails the stage (a wrong format is no small dataset)
    max_reject_fraction: Annotated[Float, Field(ge=0.0, le=1.0)] = 0.5
    # a conversation that opens with an assistant turn: drop that turn, or reject the row
    leading_assistant: Literal["drop_turn", "reject"] = "drop_turn"
    # a source file that ends part-way (a stopped download): fail, or keep the whole rows before the cut (reported)
    truncated_source: Literal["fail", "keep"] = "fail"


@section
class TinyTargetConfig:
    """Shape and training budget of the `builtin:tiny` target."""
    vocab_size: Annotated[Int, Field(ge=512)] = 4096
    hidden_size: Annotated[Int, Field(ge=16)] = 128
    num_layers: Annotated[Int, Field(ge=2)] = 36
    num_heads: Annotated[Int, Field(ge=1)] = 4
    num_kv_heads: Annotated[Int, Field(ge=1)] = 2
    head_dim: Annotated[Int, Field(ge=4)] = 32
    intermediate_size: Annotated[Int, Field(ge=16)] = 384
    seq_len: Annotated[Int, Field(ge=32)] = 256
    batch_size: Annotated[Int, Field(ge=1)] = 4
    steps: Annotated[Int, Field(ge=1)] = 500
    lr: Annotated[Float, Field(gt=0.0)] = 6e-3
    muon_lr: Annotated[Float, Field(gt=0.0)] = 0.02
    warmup_steps: Annotated[Int, Field(ge=0)] = 20
    weight_decay: Annotated[Float, Field(ge=0.0)] = 0.0
    pretrain_weight: Annotated[Float, Field(ge=0.0, le=1.0)] = 0.3
    synthetic_rows: Annotated[Int, Field(ge=0)] = 4000
    heldout_fraction: Annotated[Float, Field(gt=0.0, lt=1.0)] = 0.05
    threads: Annotated[Int, Field(ge=0)] = 0


@section
class TargetConfig:
    source: Str = "builtin:tiny"
    seed: Annotated[Int, Field(ge=0)] = 0
    tiny: TinyTargetConfig = field(default_factory=TinyTargetConfig)


@section
class SamplingConfig:
    temperature: Annotated[Float, Field(ge=0.0)] = 0.7
    top_p: Annotated[Float, Field(gt=0.0, le=1.0)] = 0.8
    top_k: Annotated[Int, Field(ge=0)] = 20
    min_p: Annotated[Float, Field(ge=0.0, le=1.0)] = 0.0
    max_tokens: Annotated[Int, Field(ge=1)] = 64
    seed: Annotated[Int, Field(ge=0)] = 0


@section
class RegenConfig:
    # local: the target in this process, batches fixed by the rows (reproducible; deepspec.data.generate)
    backend: Literal["local", "transformers", "sglang", "openai"] = "local"
    urls: list[Str] = field(default_factory=list)
    model: Str = ""
    fraction: Annotated[Float, Field(gt=0.0, le=1.0)] = 0.5
    concurrency: Annotated[Int, Field(ge=1)] = 32
    batch_tokens: Annotated[Int, Field(ge=1)] | None = None  # local: cap on rows x (longest prompt + max_tokens)
    timeout_s: Annotated[Float, Field(gt=0.0)] = 120.0
    max_retries: Annotated[Int, Field(ge=0)] = 4
    backoff_s: Annotated[Float, Field(ge=0.0)] = 0.5
    max_error_fraction: Annotated[Float, Field(ge=0.0, le=1.0)] = 0.02
    disable_thinking: Bool = True
    launch_servers: Annotated[Int, Field(ge=0)] = 0
    server_port: Annotated[Int, Field(ge=0, le=65535)] = 0
    server_start_timeout_s: Annotated[Float, Field(gt=0.0)] = 300.0
    api_key_env: Str = "OPENAI_API_KEY"
    deterministic: Bool = True  # launched sglang servers: --enable-deterministic-inference (slower; answers reused)


@section
class CacheConfig:
    launcher: Str = "python"          # the stage's command prefix, e.g. "torchrun --nproc-per-node 8"
    url: Str = "data/cache.zarr"
    format: Literal["zarr", "hdf5"] = "zarr"
    dtype: Literal["bfloat16", "fp8"] = "bfloat16"
    codec: Literal["none", "blosc-zstd", "blosc-lz4"] = "none"
    max_length: Annotated[Int, Field(ge=8)] = 1024
    # a conversation over max_length tokens: cut after the last whole answer that fits, cut at exactly
    # max_length (mid-answer), or dropped
    overlong: Literal["cut_turn", "truncate", "drop"] = "cut_turn"
    # an answer cut by sampling.max_tokens: keep the row (that end of turn gets no loss) or drop it
    truncated: Literal["keep", "drop"] = "keep"
    batch_tokens: Annotated[Int, Field(ge=64)] = 8192
    part_tokens: Annotated[Int, Field(ge=1)] = 65536
    shard_bytes: Annotated[Int, Field(ge=2**16)] = 512 * 2**20
    chunk_tokens: Annotated[Int, Field(ge=1)] = 64
    storage_options: dict[Str, Any] = field(default_factory=dict)
    threads: Annotated[Int, Field(ge=0)] = 0
    # multi-rank: how long a collective (index shares, store snapshot, barriers) waits for the slowest rank
    collective_timeout_s: Annotated[Int, Field(ge=10)] = 1800
    # where a store of new content may be derived from instead of running the target
    # (deepspec.cache.build.derive): "" = the store at a local url / the lake's other stores; a path or
    # s3:// URL = that store; "none" = always compute
    derive_from: Str = ""
    # ranks a target is sharded over by transformers' tensor-parallel plan (a target larger than one GPU):
    # torchrun's N ranks form N/k groups, each computing its share of the parts (models/tensor_parallel.py)
    tensor_parallel: Annotated[Int, Field(ge=1)] = 1


@section
class TrainConfig:
    launcher: Str = "python"
    algorithm: Literal["dspark", "dflash", "eagle3"] = "dspark"
    layers: list[Int] | None = None   # eagle3 takes exactly three (null: the lowest, middle and highest cached)
    block_size: Annotated[Int, Field(ge=2)] = 4
    draft_layers: Annotated[Int, Field(ge=1)] = 1
    markov_rank: Annotated[Int, Field(ge=1)] = 64
    # mask slots = the target's embedding row of this reserved token (frozen), as speculators and dflash
    # build them; null = the target tokenizer's mask token, else its first unused embedding row;
    # -1 = a learned mask vector instead (no serving engine can load that: export refuses it)
    mask_token_id: Annotated[Int | None, Field(ge=-1)] = None
    # true: slot k predicts token a+k+1 (γ drafts; DSpark's convention); false: slot 0's output is
    # unused and slot k predicts token a+k (γ-1 drafts; the dflash package's layout); null = the
    # algorithm's default (dspark: true, dflash: false), as in speculators
    sample_from_anchor: Bool | None = None
    # eagle3: chain steps unrolled in training (the training-time test) and drafted per round in eval
    ttt_steps: Annotated[Int, Field(ge=1)] = 4
    # eagle3: reduced draft vocabulary, the most frequent loss tokens of the cache (d2t/t2d); capped at the
    # target's vocabulary
    draft_vocab_size: Annotated[Int, Field(ge=1)] = 2048
    anchors_per_sample: Annotated[Int, Field(ge=1)] = 16
    batch_size: Annotated[Int, Field(ge=1)] = 8
    grad_accum: Annotated[Int, Field(ge=1)] = 1
    steps: Annotated[Int, Field(ge=1)] = 1000
    lr: Annotated[Float, Field(gt=0.0)] = 3e-3
    min_lr_ratio: Annotated[Float, Field(ge=0.0, le=1.0)] = 0.1
    warmup_steps: Annotated[Int, Field(ge=0)] = 50
    schedule: Literal["cosine", "sgdr", "constant"] = "cosine"
    sgdr_period: Annotated[Int, Field(ge=1)] = 100
    sgdr_mult: Annotated[Float, Field(ge=1.0)] = 2.0
    # AdamW: weight decay, betas and eps (recipes differ: the defaults are what deepspec always used)
    weight_decay: Annotated[Float, Field(ge=0.0)] = 0.0
    adam_betas: Annotated[list[Annotated[Float, Field(ge=0.0, lt=1.0)]], Field(min_length=2, max_length=2)] = \
        field(default_factory=lambda: [0.9, 0.95])
    adam_eps: Annotated[Float, Field(gt=0.0)] = 1e-8
    grad_clip: Annotated[Float, Field(ge=0.0)] = 1.0
    ce_weight: Annotated[Float, Field(ge=0.0)] = 0.1
    l1_weight: Annotated[Float, Field(ge=0.0)] = 0.9
    conf_weight: Annotated[Float, Field(ge=0.0)] = 1.0
    decay_gamma: Annotated[Float, Field(gt=0.0)] = 4.0
    checkpoint_every: Annotated[Int, Field(ge=1)] = 500
    keep_checkpoints: Annotated[Int, Field(ge=1)] = 2
    # loading processes beside each training process; auto = by device (devices.loader_workers)
    num_workers: Annotated[Int, Field(ge=0)] | Literal["auto"] = "auto"
    # torch.compile the draft's training forward and loss (deepspec/train/compiled.py); auto = on CUDA,
    # where small steps are bound by kernel launches, off on the CPU, where a run must last long enough to
    # earn the compile back (benchmarks/compile_step.py)
    compile: Bool | Literal["auto"] = "auto"
    # cache on S3: byte-range requests the loader keeps in flight (a batch's arrays, cut to 4 MB)
    read_ahead: Annotated[Int, Field(ge=1)] = 16
    # cache on S3: a local directory the parts' arrays are downloaded into whole, each once, and read
    # from (deepspec/cache/read/mirror.py); "" reads byte ranges of the store. Bounded by mirror_gb
    # per loading process, least recently used arrays out
    mirror: Str = ""
    mirror_gb: Annotated[Float, Field(gt=0.0)] = 100.0
    # where resume state lives: "" = data/train_state; an fsspec URL (s3://bucket/prefix) lets ranks on
    # several nodes resume with nothing shared but the bucket; its fsspec options (endpoint, region;
    # credentials come from the environment, as for the cache)
    state_url: Str = ""
    state_storage_options: dict[Str, Any] = field(default_factory=dict)
    # 0: each epoch a random order of all samples; W: the parts in a random order W at a time, samples
    # shuffled within (a mirror of a store too large for local disk); growing: the first epoch in windows
    # of 2, 2, 4, 8... parts, later epochs as 0; auto: growing for read-through, else 0 (trainer.window_of)
    window_parts: Annotated[Int, Field(ge=0)] | Literal["auto", "growing"] = "auto"
    # read-through: the cache stage only plans; train writes each part before it first reads it (fill.py),
    # in the training process or, under torchrun, on the last `capture_ranks` ranks (fill_ranks.py)
    capture: Literal["offline", "read-through"] = "offline"
    capture_ranks: Annotated[Int, Field(ge=0)] = 0
    seed: Annotated[Int, Field(ge=0)] = 0
    threads: Annotated[Int, Field(ge=0)] = 0
    # multi-rank: how long a collective waits for the slowest rank (rank 0 alone reads the corpus for
    # EAGLE-3's vocabulary, or writes a checkpoint, while the others wait)
    collective_timeout_s: Annotated[Int, Field(ge=10)] = 1800


@section
class SuiteConfig:
    """One named prompt set of the eval stage (see deepspec/evaluate/suites.py)."""
    source: Str = "heldout"           # heldout | humaneval | mtbench | path/to/file.jsonl ({"turns": [...]} rows)
    name: Str = ""                    # "" = the source's name (a file's stem)
    max_prompts: Annotated[Int, Field(ge=0)] = 0    # 0 = every prompt of the suite

    def __post_init__(self) -> None:
        self.name = self.name or suite_name(self.source)
        if not re.fullmatch(r"[A-Za-z0-9_-]+", self.name):  # it becomes a metrics key: `dvc exp show` column heldout.tau
            raise ConfigError(f"name {self.name!r} must be letters, digits, '_' or '-' (set `name:`)")


def _default_suites() -> list[SuiteConfig]:
    return [SuiteConfig("heldout", max_prompts=24), SuiteConfig("humaneval", max_prompts=6),
            SuiteConfig("mtbench", max_prompts=4)]


@section
class EvalConfig:
    suites: list[SuiteConfig] = field(default_factory=_default_suites)
    max_new_tokens: Annotated[Int, Field(ge=1)] = 64  # per user turn
    thinking: Bool = False              # the chat template's enable_thinking switch
    sample: Bool = True
    confidence_threshold: Annotated[Float, Field(ge=0.0, le=1.0)] = 0.0
    threads: Annotated[Int, Field(ge=0)] = 0
    launcher: Str = "python"            # "torchrun --nproc-per-node k" with tensor_parallel: k
    # ranks the target is sharded over (transformers' tensor-parallel plan); every rank decodes every
    # prompt with its own draft, in lockstep with the others (models/tensor_parallel.py)
    tensor_parallel: Annotated[Int, Field(ge=1)] = 1

    def __post_init__(self) -> None:
        if not self.suites:
            raise ConfigError("suites: must list at least one suite")
        names = [s.name for s in self.suites]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ConfigError(f"suites: names must be unique, {dup[0]!r} appears twice (set `name:`)")


def suite_name(source: str) -> str:
    """`heldout` -> heldout, `path/to/mt_bench.jsonl` -> mt_bench."""
    return Path(source).stem if source.endswith(".jsonl") else source


EXPORT_FORMATS = ("speculators", "dflash", "sglang-eagle3")


@section
class ExportConfig:
    formats: list[Literal["speculators", "dflash", "sglang-eagle3"]] = field(default_factory=lambda: list(EXPORT_FORMATS))
    dtype: Literal["bfloat16", "float32"] = "bfloat16"
    verifier: Str = ""        # "" = the hub id for hf: targets, the target model directory otherwise

    def __post_init__(self) -> None:
        if len(set(self.formats)) != len(self.formats):
            raise ConfigError(f"formats: listed twice in {self.formats}")


@section
class Params:
    layers: list[Int] = field(default_factory=lambda: [1, 9, 17, 25, 33])
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    split: SplitConfig = field(default_factory=SplitConfig)
    target: TargetConfig = field(default_factory=TargetConfig)
    regen: RegenConfig = field(default_factory=RegenConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    export: ExportConfig = field(default_factory=ExportConfig)

    def __post_init__(self) -> None:
        if not self.layers:
            raise ConfigError("layers: must list at least one layer id, got []")
        if len(set(self.layers)) != len(self.layers):
            raise ConfigError(f"layers: ids must be unique, got {self.layers}")
        if any(i < -1 for i in self.layers):
            raise ConfigError(f"layers: ids must be >= -1 (-1 = embedding output), got {self.layers}")
        if self.train.layers is not None:
            missing = [i for i in self.train.layers if i not in self.layers]
            if missing:
                raise ConfigError(
                    f"train.layers: {missing} are not cached; the cache holds layers {self.layers}")
        eagle = self.train.layers if self.train.layers is not None else self.layers
        if self.train.algorithm == "eagle3" and len(eagle) != 3 and (self.train.layers is not None or len(eagle) < 3):
            raise ConfigError(f"train.layers: eagle3 fuses exactly three target layers, got {eagle}"
                              + ("" if self.train.layers is not None else " (the cached layers)"))

    @property
    def train_layers(self) -> list[int]:
        """The draft's input layers; eagle3 without train.layers takes the lowest, middle and highest of
        the cached layers (EAGLE-3's low/mid/high features; [1, 17, 33] of the default cache)."""
        if self.train.layers is not None:
            return list(self.train.layers)
        if self.train.algorithm == "eagle3":
            cached = sorted(self.layers)
            return [cached[0], cached[len(cached) // 2], cached[-1]]
        return list(self.layers)


def to_dict(obj: Any) -> Any:
    return dataclasses.asdict(obj)
