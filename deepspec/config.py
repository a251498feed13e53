"""Typed view of params.yaml.

Every section is a dataclass; `load_params` checks each key against the dataclass fields so an
unknown key, a wrong type or an out-of-range value fails with the key path and the bad value,
before any stage does expensive work.
"""
from __future__ import annotations

import dataclasses
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml


class ConfigError(ValueError):
    pass


def _f(default: Any = dataclasses.MISSING, *, ge=None, gt=None, le=None, lt=None, factory=None):
    meta = {k: v for k, v in dict(ge=ge, gt=gt, le=le, lt=lt).items() if v is not None}
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class SplitConfig:
    source: str = "builtin:chat"
    seed: int = _f(0, ge=0)
    test_fraction: float = _f(0.05, ge=0.0, lt=1.0)
    hf_split: str = "train"
    # more rejected rows than this fraction of those read fails the stage: a source in the wrong
    # format must not pass as a small dataset
    max_reject_fraction: float = _f(0.5, ge=0.0, le=1.0)
    # a conversation that opens with an assistant turn: drop that turn, or reject the row
    leading_assistant: Literal["drop_turn", "reject"] = "drop_turn"
    # a source file that ends part-way (a download that stopped): fail, or keep the whole rows before
    # the cut (the report says where it was cut)
    truncated_source: Literal["fail", "keep"] = "fail"


@dataclass
class TinyTargetConfig:
    """Shape and training budget of the `builtin:tiny` target."""
    vocab_size: int = _f(4096, ge=512)
    hidden_size: int = _f(128, ge=16)
    num_layers: int = _f(36, ge=2)
    num_heads: int = _f(4, ge=1)
    num_kv_heads: int = _f(2, ge=1)
    head_dim: int = _f(32, ge=4)
    intermediate_size: int = _f(384, ge=16)
    seq_len: int = _f(256, ge=32)
    batch_size: int = _f(4, ge=1)
    steps: int = _f(500, ge=1)
    lr: float = _f(6e-3, gt=0.0)
    muon_lr: float = _f(0.02, gt=0.0)
    warmup_steps: int = _f(20, ge=0)
    weight_decay: float = _f(0.0, ge=0.0)
    pretrain_weight: float = _f(0.3, ge=0.0, le=1.0)
    synthetic_rows: int = _f(4000, ge=0)
    heldout_fraction: float = _f(0.05, gt=0.0, lt=1.0)
    threads: int = _f(0, ge=0)


@dataclass
class TargetConfig:
    source: str = "builtin:tiny"
    seed: int = _f(0, ge=0)
    tiny: TinyTargetConfig = field(default_factory=TinyTargetConfig)


@dataclass
class SamplingConfig:
    temperature: float = _f(0.7, ge=0.0)
    top_p: float = _f(0.8, gt=0.0, le=1.0)
    top_k: int = _f(20, ge=0)
    min_p: float = _f(0.0, ge=0.0, le=1.0)
    max_tokens: int = _f(64, ge=1)
    seed: int = _f(0, ge=0)


@dataclass
class RegenConfig:
    # local: the target in this process, batches fixed by the rows (reproducible; deepspec.data.generate)
    backend: Literal["local", "transformers", "sglang", "openai"] = "local"
    urls: list[str] = _f(factory=list)
    model: str = ""
    fraction: float = _f(0.5, gt=0.0, le=1.0)
    concurrency: int = _f(32, ge=1)
    timeout_s: float = _f(120.0, gt=0.0)
    max_retries: int = _f(4, ge=0)
    backoff_s: float = _f(0.5, ge=0.0)
    max_error_fraction: float = _f(0.02, ge=0.0, le=1.0)
    disable_thinking: bool = True
    launch_servers: int = _f(0, ge=0)
    server_port: int = _f(0, ge=0, le=65535)
    server_start_timeout_s: float = _f(300.0, gt=0.0)
    api_key_env: str = "OPENAI_API_KEY"
    # sglang servers this stage launches run with --enable-deterministic-inference (slower, but the
    # same params give the same answers, so the cache downstream is reused)
    deterministic: bool = True


@dataclass
class CacheConfig:
    launcher: str = "python"          # the stage's command prefix, e.g. "torchrun --nproc-per-node 8"
    url: str = "data/cache.zarr"
    format: Literal["zarr", "hdf5"] = "zarr"
    dtype: Literal["bfloat16", "fp8"] = "bfloat16"
    codec: Literal["none", "blosc-zstd", "blosc-lz4"] = "none"
    max_length: int = _f(1024, ge=8)
    # a conversation over max_length tokens: cut after the last whole answer that fits, cut at exactly
    # max_length (mid-answer), or dropped
    overlong: Literal["cut_turn", "truncate", "drop"] = "cut_turn"
    # a row whose answer was cut by sampling.max_tokens: keep it (that end of turn gets no loss) or drop it
    truncated: Literal["keep", "drop"] = "keep"
    batch_tokens: int = _f(8192, ge=64)
    part_tokens: int = _f(65536, ge=1)
    shard_bytes: int = _f(512 * 2**20, ge=2**16)
    chunk_tokens: int = _f(64, ge=1)
    storage_options: dict[str, Any] = _f(factory=dict)
    threads: int = _f(0, ge=0)
    # multi-rank: how long a collective (the index shares, the store snapshot, the barriers) waits for
    # the slowest rank before the job fails; raise it for inputs whose share takes a rank longer
    collective_timeout_s: int = _f(1800, ge=10)
    # where a store of new content may be derived from instead of running the target
    # (deepspec.cache.derive): "" = the store at a local url / the lake's other stores; a path or
    # s3:// URL = that store; "none" = always compute
    derive_from: str = ""


@dataclass
class TrainConfig:
    launcher: str = "python"
    algorithm: Literal["dspark", "dflash", "eagle3"] = "dspark"
    layers: list[int] | None = None   # eagle3 takes exactly three (null: the lowest, middle and highest cached)
    block_size: int = _f(4, ge=2)
    draft_layers: int = _f(1, ge=1)
    markov_rank: int = _f(64, ge=1)
    # mask slots = the target's embedding row of this reserved token (frozen), as speculators and dflash
    # build them; null = the target tokenizer's mask token, else its first unused embedding row;
    # -1 = a learned mask vector instead (no serving engine can load that: export refuses it)
    mask_token_id: int | None = _f(None, ge=-1)
    # true: slot k predicts token a+k+1 (γ drafts; DSpark's convention); false: slot 0's output is
    # unused and slot k predicts token a+k (γ-1 drafts; the dflash package's layout); null = the
    # algorithm's default (dspark: true, dflash: false), as in speculators
    sample_from_anchor: bool | None = None
    # eagle3: chain steps unrolled in training (the training-time test) and drafted per round in eval
    ttt_steps: int = _f(4, ge=1)
    # eagle3: reduced draft vocabulary, the most frequent loss tokens of the cache (d2t/t2d); capped at the
    # target's vocabulary
    draft_vocab_size: int = _f(2048, ge=1)
    anchors_per_sample: int = _f(16, ge=1)
    batch_size: int = _f(8, ge=1)
    grad_accum: int = _f(1, ge=1)
    steps: int = _f(1000, ge=1)
    lr: float = _f(3e-3, gt=0.0)
    min_lr_ratio: float = _f(0.1, ge=0.0, le=1.0)
    warmup_steps: int = _f(50, ge=0)
    schedule: Literal["cosine", "sgdr", "constant"] = "cosine"
    sgdr_period: int = _f(100, ge=1)
    sgdr_mult: float = _f(2.0, ge=1.0)
    weight_decay: float = _f(0.0, ge=0.0)
    grad_clip: float = _f(1.0, ge=0.0)
    ce_weight: float = _f(0.1, ge=0.0)
    l1_weight: float = _f(0.9, ge=0.0)
    conf_weight: float = _f(1.0, ge=0.0)
    decay_gamma: float = _f(4.0, gt=0.0)
    checkpoint_every: int = _f(500, ge=1)
    keep_checkpoints: int = _f(2, ge=1)
    num_workers: int = _f(0, ge=0)
    # cache on S3: byte-range requests the loader keeps in flight (a batch's arrays, cut to 4 MB);
    # one stream gives ~50-100 MB/s, a GPU training a Qwen3-4B draft reads ~1 GB/s
    read_ahead: int = _f(16, ge=1)
    seed: int = _f(0, ge=0)
    threads: int = _f(0, ge=0)


@dataclass
class SuiteConfig:
    """One named prompt set of the eval stage (see deepspec/evaluate/suites.py)."""
    source: str = "heldout"           # heldout | humaneval | mtbench | path/to/file.jsonl ({"turns": [...]} rows)
    name: str = ""                    # "" = the source's name (a file's stem)
    max_prompts: int = _f(0, ge=0)    # 0 = every prompt of the suite

    def __post_init__(self) -> None:
        self.name = self.name or suite_name(self.source)
        if not re.fullmatch(r"[A-Za-z0-9_-]+", self.name):  # it becomes a metrics key: `dvc exp show` column heldout.tau
            raise ConfigError(f"name {self.name!r} must be letters, digits, '_' or '-' (set `name:`)")


def _default_suites() -> list[SuiteConfig]:
    return [SuiteConfig("heldout", max_prompts=24), SuiteConfig("humaneval", max_prompts=6),
            SuiteConfig("mtbench", max_prompts=4)]


@dataclass
class EvalConfig:
    suites: list[SuiteConfig] = _f(factory=_default_suites)
    max_new_tokens: int = _f(64, ge=1)  # per user turn
    thinking: bool = False              # the chat template's enable_thinking switch
    sample: bool = True
    confidence_threshold: float = _f(0.0, ge=0.0, le=1.0)
    threads: int = _f(0, ge=0)

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


@dataclass
class ExportConfig:
    formats: list[Literal["speculators", "dflash", "sglang-eagle3"]] = _f(factory=lambda: list(EXPORT_FORMATS))
    dtype: Literal["bfloat16", "float32"] = "bfloat16"
    verifier: str = ""        # "" = the hub id for hf: targets, the target model directory otherwise

    def __post_init__(self) -> None:
        if len(set(self.formats)) != len(self.formats):
            raise ConfigError(f"formats: listed twice in {self.formats}")


@dataclass
class Params:
    layers: list[int] = _f(factory=lambda: [1, 9, 17, 25, 33])
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


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _convert(value: Any, tp: Any, path: str) -> Any:
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _convert(value, arg, path)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0] if len(errors) == 1 else f"{path}: {value!r} matches none of {tp}")
    if origin is Literal:
        choices = typing.get_args(tp)
        if value not in choices:
            raise ConfigError(f"{path}: {value!r} is not one of {list(choices)}")
        return value
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{path}: expected a list, got {value!r}")
        (item_tp,) = typing.get_args(tp)
        return [_convert(v, item_tp, f"{path}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{path}: expected a mapping, got {value!r}")
        return dict(value)
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, path)
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{path}: expected true/false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{path}: expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{path}: expected a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{path}: expected a string, got {value!r}")
        return value
    raise ConfigError(f"{path}: unsupported type {_type_name(tp)}")


def _check_range(value: Any, meta: typing.Mapping, path: str) -> None:
    if value is None or isinstance(value, (str, bool)) or not isinstance(value, (int, float)):
        return
    for op, bound in meta.items():
        ok = {"ge": value >= bound, "gt": value > bound, "le": value <= bound, "lt": value < bound}[op]
        if not ok:
            sym = {"ge": ">=", "gt": ">", "le": "<=", "lt": "<"}[op]
            raise ConfigError(f"{path}: must be {sym} {bound}, got {value!r}")


def _build(cls: type, raw: Any, path: str) -> Any:
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{path or 'params'}: expected a mapping, got {raw!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - set(fields))
    if unknown:
        where = f"{path}." if path else ""
        raise ConfigError(f"{where}{unknown[0]}: unknown key (known: {sorted(fields)})")
    kwargs = {}
    for name, value in raw.items():
        key = f"{path}.{name}" if path else name
        converted = _convert(value, hints[name], key)
        _check_range(converted, fields[name].metadata, key)
        if isinstance(converted, list):
            for i, v in enumerate(converted):
                _check_range(v, fields[name].metadata, f"{key}[{i}]")
        kwargs[name] = converted
    try:
        return cls(**kwargs)
    except ConfigError as e:
        raise ConfigError(f"{path}.{e}" if path else str(e)) from None


def params_from_dict(raw: Any) -> Params:
    return _build(Params, raw, "")


def load_params(path: str | Path = "params.yaml") -> Params:
    path = Path(path)
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"{path}: file not found") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from None
    try:
        return params_from_dict(raw)
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None


def to_dict(obj: Any) -> Any:
    return dataclasses.asdict(obj)
