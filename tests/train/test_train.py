"""Draft training: learning, frozen embeddings, exact resume, layer subsets, DDP, bad checkpoints."""
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from safetensors.torch import load_file

from deepspec.config import TrainConfig
from deepspec.loader.collate import collate
from deepspec.loader.dataset import TargetCacheDataset
from deepspec.models.draft import DraftModel
from deepspec.models.registry import load_draft
from deepspec.train.checkpoint import list_checkpoints
from deepspec.models.objectives import block_mask
from deepspec.train.run import run_training
from deepspec.train.schedule import lr_factor
from tests.conftest import REPO, project_env

FAST = dict(block_size=3, draft_layers=1, markov_rank=16, anchors_per_sample=6, batch_size=4, steps=40,
            lr=5e-3, warmup_steps=4, checkpoint_every=10, seed=0)


def train(tmp_path, small_cache, trained_target, layers=(-1, 0, 2), **kw):
    cfg = TrainConfig(**{**FAST, **kw})
    final = run_training(cfg, list(layers), str(small_cache), trained_target, tmp_path / "draft",
                         tmp_path / "train", tmp_path / "state")
    return cfg, final


def losses(tmp_path):
    tsv = tmp_path / "train" / "live" / "plots" / "metrics" / "train" / "loss.tsv"
    rows = [line.split("\t") for line in tsv.read_text().splitlines()]
    col = rows[0].index("loss")
    return [float(r[col]) for r in rows[1:]]


def test_loss_falls_and_frozen_parameters_stay_identical(tmp_path, small_cache, trained_target):
    from transformers import AutoModelForCausalLM

    cfg, final = train(tmp_path, small_cache, trained_target, steps=80)
    curve = losses(tmp_path)
    assert len(curve) == 80
    assert sum(curve[-10:]) / 10 < 0.6 * sum(curve[:5]) / 5
    assert json.loads((tmp_path / "train" / "metrics.json").read_text())["steps"] == 80
    draft = DraftModel.load(tmp_path / "draft")
    target = AutoModelForCausalLM.from_pretrained(trained_target)
    assert torch.equal(draft.embed_tokens.weight, target.get_input_embeddings().weight)
    assert torch.equal(draft.lm_head.weight, target.get_output_embeddings().weight)
    assert not draft.embed_tokens.weight.requires_grad and not draft.lm_head.weight.requires_grad


def test_dflash_has_no_heads_and_trains(tmp_path, small_cache, trained_target):
    train(tmp_path, small_cache, trained_target, algorithm="dflash", steps=20)
    draft = DraftModel.load(tmp_path / "draft")
    assert draft.markov_in is None and draft.confidence_head is None
    assert not any(k.startswith(("markov", "confidence")) for k in load_file(tmp_path / "draft" / "model.safetensors"))


def test_mask_slots_are_the_targets_reserved_token_row(tmp_path, small_cache, trained_target):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(trained_target)
    train(tmp_path, small_cache, trained_target, steps=10)
    draft = DraftModel.load(tmp_path / "draft")
    assert (draft.config.mask_token_id, draft.config.mask_token) == (tok.mask_token_id, "<|MASK|>")
    assert draft.config.sample_from_anchor is True                      # DSpark's convention by default
    assert draft.mask_embedding is None and "mask_embedding" not in load_file(tmp_path / "draft" / "model.safetensors")
    row = AutoModelForCausalLM.from_pretrained(trained_target).get_input_embeddings().weight[tok.mask_token_id]
    assert torch.equal(draft.mask_vector(), row) and not draft.mask_vector().requires_grad
    train(tmp_path / "learned", small_cache, trained_target, steps=10, mask_token_id=-1)
    learned = DraftModel.load(tmp_path / "learned" / "draft")
    assert learned.config.mask_token_id == -1 and learned.mask_embedding.requires_grad


def test_mask_token_resolution():
    from types import SimpleNamespace

    from deepspec.config import ConfigError
    from deepspec.train.run import resolve_mask_token

    class Tok(SimpleNamespace):
        def __len__(self):
            return self.n

        def convert_ids_to_tokens(self, i):
            return f"<t{i}>"

    with_mask, no_mask = Tok(n=10, mask_token_id=4), Tok(n=10, mask_token_id=None)
    assert resolve_mask_token(TrainConfig(), with_mask, 16) == (4, "<t4>")
    assert resolve_mask_token(TrainConfig(), no_mask, 16) == (10, "<|MASK|>")   # first unused row (Qwen3: 151669)
    assert resolve_mask_token(TrainConfig(mask_token_id=7), no_mask, 16) == (7, "<t7>")
    assert resolve_mask_token(TrainConfig(mask_token_id=-1), with_mask, 16) == (-1, "")
    with pytest.raises(ConfigError, match="train.mask_token_id: the target's tokenizer has no mask token"):
        resolve_mask_token(TrainConfig(), no_mask, 10)
    with pytest.raises(ConfigError, match="every special token occurs in the cache"):
        resolve_mask_token(TrainConfig(), no_mask, 10, cache_ids=lambda: np.arange(10))
    with pytest.raises(ConfigError, match="train.mask_token_id: 16 is not a token"):
        resolve_mask_token(TrainConfig(mask_token_id=16), with_mask, 16)


@pytest.mark.parametrize("gguf", ["smollm2"])
def test_a_tokenizer_without_mask_token_or_unused_row_gets_a_special_token_the_cache_never_holds(gguf, caplog):
    # SmolLM2 (Llama family): 49,152 tokens = its embedding rows, no mask token
    from transformers import AutoTokenizer

    from deepspec.models.prepare import smollm2_gguf
    from deepspec.train.run import resolve_mask_token

    path = smollm2_gguf()
    tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    assert tok.mask_token_id is None and len(tok) == 49152
    text = tok.apply_chat_template([{"role": "user", "content": "hi <repo_name>"},
                                    {"role": "assistant", "content": "hello"}], tokenize=False)
    used = np.unique(tok(text, add_special_tokens=False)["input_ids"])
    assert 3 in used  # <repo_name> occurs in this cache
    with caplog.at_level("INFO"):
        mid, text = resolve_mask_token(TrainConfig(), tok, 49152, cache_ids=lambda: used)
    assert mid == 4 and text == "<reponame>"
    assert mid not in used and mid not in (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id)
    assert "mask token <reponame> (id 4): a special token (<reponame>) that occurs nowhere" in caplog.text
    # an explicit id still wins, without reading the cache
    assert resolve_mask_token(TrainConfig(mask_token_id=5), tok, 49152, cache_ids=None) == (5, "<file_sep>")


def test_a_reserved_special_token_is_preferred_and_the_cache_is_scanned_once(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from deepspec.train.run import resolve_mask_token

    vocab = {f"w{i}": i for i in range(20)}
    core = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="w0", eos_token="<eos>")
    tok.add_special_tokens({"additional_special_tokens": ["<tool>", "<|reserved_special_token_0|>"]})
    calls = []

    def cache_ids():
        calls.append(1)
        return np.arange(20)

    mid, text = resolve_mask_token(TrainConfig(), tok, len(tok), cache_ids=cache_ids)
    assert text == "<|reserved_special_token_0|>" and mid == tok.convert_tokens_to_ids(text) and calls == [1]


def test_dflash_layout_trains_gamma_minus_one_drafts(tmp_path, small_cache, trained_target):
    """sample_from_anchor false: slot 0's output is unused, slot k predicts the token at a+k."""
    from deepspec.models.objectives import draft_loss, sample_anchors

    train(tmp_path, small_cache, trained_target, algorithm="dflash", block_size=4, steps=20)
    draft = DraftModel.load(tmp_path / "draft")
    assert draft.config.sample_from_anchor is False and draft.config.num_drafts == 3   # dflash's default
    ds = TargetCacheDataset(str(small_cache), layers=[-1, 0, 2])
    batch = collate([ds[i] for i in range(4)])
    batch["input_ids"] = batch["input_ids"].long()
    anchors = sample_anchors(batch["loss_mask"], batch["lengths"], 4, torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = draft_loss(draft, batch, anchors, 1.0, 0.0, 0.0, 4.0)
    assert {k for k in out.metrics if k.startswith("acc@")} == {"acc@0", "acc@1", "acc@2"}
    # one anchor, only draft 0 weighted: the CE is that of slot 1's logits against token a+1
    one = {k: v[:1] if isinstance(v, (torch.Tensor, list)) else v for k, v in batch.items()}
    first = type(anchors)(anchors.pos[:1, :1], anchors.keep[:1, :1])
    a, T = int(first.pos[0, 0]), one["input_ids"].shape[1]
    with torch.no_grad():
        h = draft.block_states(one["input_ids"][:, a:a + 1], first.pos, draft.context(one["hidden"].float()),
                               torch.arange(T)[None], block_mask(first, one["lengths"], T, 4))
        ce = torch.nn.functional.cross_entropy(draft.lm_head(h[0, 0, 1])[None], one["input_ids"][0, a + 1][None])
        single = draft_loss(draft, one, first, 1.0, 0.0, 0.0, 1e-9)
    assert float(single.metrics["ce"]) == pytest.approx(float(ce), rel=1e-5)


def test_new_train_params_are_in_the_resume_fingerprint(tmp_path, small_cache, trained_target):
    def fingerprint():
        return json.loads((list_checkpoints(tmp_path / "state")[-1] / "meta.json").read_text())["fingerprint"]

    seen = set()
    for kw in ({}, {"mask_token_id": -1}, {"sample_from_anchor": False}):
        train(tmp_path, small_cache, trained_target, steps=2, checkpoint_every=2, **kw)
        seen.add(fingerprint())
    assert len(seen) == 3


def test_layer_subset_trains_without_recomputing_the_cache(tmp_path, small_cache, trained_target):
    train(tmp_path, small_cache, trained_target, layers=(2,), steps=10)
    draft = DraftModel.load(tmp_path / "draft")
    assert draft.config.target_layers == [2]
    assert draft.fc.weight.shape[1] == draft.config.target_hidden_size


def test_resume_restores_every_state_and_bad_checkpoints_are_skipped(tmp_path, small_cache, trained_target, caplog):
    train(tmp_path / "full", small_cache, trained_target)
    full = load_file(tmp_path / "full" / "draft" / "model.safetensors")
    part = tmp_path / "part"
    train(part, small_cache, trained_target, steps=40)  # runs to the end: checkpoints 10, 20, 30, 40 (2 kept)
    ckpts = list_checkpoints(part / "state")
    assert [c.name for c in ckpts] == ["ckpt-00000030", "ckpt-00000040"]
    # pretend the run died just after saving step 30: drop the newer one, truncate a file of step 40 instead
    shutil.rmtree(ckpts[1])
    train(part, small_cache, trained_target, steps=40)  # resumes from step 30
    assert load_file(part / "draft" / "model.safetensors").keys() == full.keys()
    for k, v in load_file(part / "draft" / "model.safetensors").items():
        assert torch.equal(v, full[k]), k
    assert len(losses(part)) == 40  # the curve holds each step once
    bad = list_checkpoints(part / "state")[-1] / "model.safetensors"
    bad.write_bytes(bad.read_bytes()[: bad.stat().st_size // 2])
    train(part, small_cache, trained_target, steps=40)
    assert "refusing checkpoint" in caplog.text and "content does not match" in caplog.text
    for k, v in load_file(part / "draft" / "model.safetensors").items():
        assert torch.equal(v, full[k]), k


def test_schedules():
    cfg = TrainConfig(steps=100, warmup_steps=10, min_lr_ratio=0.1)
    assert lr_factor(0, cfg) == pytest.approx(0.1) and lr_factor(9, cfg) == pytest.approx(1.0)
    assert lr_factor(99, cfg) == pytest.approx(0.1, abs=0.01)
    sgdr = TrainConfig(steps=100, warmup_steps=0, schedule="sgdr", sgdr_period=10, sgdr_mult=2.0, min_lr_ratio=0.0)
    assert lr_factor(0, sgdr) == 1.0 and lr_factor(10, sgdr) == 1.0 and lr_factor(30, sgdr) == 1.0
    assert lr_factor(9, sgdr) < 0.05 and lr_factor(20, sgdr) == pytest.approx(0.5)


def _stage_dir(tmp_path, small_cache, trained_target, **train_kw):
    work = tmp_path / "work"
    (work / "data").mkdir(parents=True)
    shutil.copytree(trained_target, work / "data" / "target")
    shutil.copytree(small_cache, work / "data" / "cache.zarr")
    params = yaml.safe_load((REPO / "params.yaml").read_text())
    params["layers"] = [-1, 0, 2]
    params["train"] = {**FAST, **train_kw}
    (work / "params.yaml").write_text(yaml.safe_dump(params))
    return work


@pytest.mark.slow
def test_sigkill_then_rerun_gives_bitwise_the_same_weights(tmp_path, small_cache, trained_target):
    clean = _stage_dir(tmp_path / "clean", small_cache, trained_target, steps=60, checkpoint_every=5)
    crash = _stage_dir(tmp_path / "crash", small_cache, trained_target, steps=60, checkpoint_every=5)
    cmd = [sys.executable, str(REPO / "stages" / "train.py")]
    env = project_env(REPO, DEEPSPEC_LOG="WARNING")
    subprocess.run(cmd, cwd=clean, env=env, check=True, capture_output=True)
    proc = subprocess.Popen(cmd, cwd=crash, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    state = crash / "data" / "train_state"
    deadline = time.time() + 300
    while time.time() < deadline and not (state.exists() and any(p.name >= "ckpt-00000025" for p in state.iterdir())):
        time.sleep(0.02)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not (crash / "data" / "draft").exists()
    subprocess.run(cmd, cwd=crash, env=env, check=True, capture_output=True)
    a = load_file(clean / "data" / "draft" / "model.safetensors")
    b = load_file(crash / "data" / "draft" / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)


def train_one_and_two_ranks(one: Path, two: Path) -> None:
    """The train stage in `one` as one process and in `two` under torchrun with 2 processes."""
    from deepspec.data.servers import free_port

    env = project_env(REPO, DEEPSPEC_LOG="WARNING")
    subprocess.run([sys.executable, str(REPO / "stages" / "train.py")], cwd=one, env=env, check=True,
                   capture_output=True)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                           "--master-port", str(free_port()), str(REPO / "stages" / "train.py")],
                          cwd=two, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


@pytest.mark.slow
def test_torchrun_two_processes_follow_the_one_process_loss_curve(tmp_path, small_cache, trained_target):
    one = _stage_dir(tmp_path / "one", small_cache, trained_target, steps=60, batch_size=8, anchors_per_sample=12)
    two = _stage_dir(tmp_path / "two", small_cache, trained_target, steps=60, batch_size=4, anchors_per_sample=12)
    train_one_and_two_ranks(one, two)
    curve_one = _curve(one)
    curve_two = _curve(two)
    assert len(curve_one) == len(curve_two) == 60
    smooth = lambda c: [sum(c[i:i + 10]) / 10 for i in range(0, 60, 10)]  # noqa: E731
    s1, s2 = smooth(curve_one), smooth(curve_two)
    assert s1[-1] < 0.7 * s1[0] and s2[-1] < 0.7 * s2[0]
    for x, y in zip(s1, s2):
        assert abs(x - y) <= 0.15 * max(x, y), (s1, s2)


@pytest.mark.slow
def test_torchrun_eagle3_ranks_share_rank_0s_draft_vocabulary(tmp_path, small_cache, trained_target):
    """The loss-token counts are taken once, on rank 0, and broadcast: both ranks build the vocabulary
    maps a one-process run builds (and agree on them, or DDP's first step would see other buffers)."""
    kw = dict(algorithm="eagle3", ttt_steps=2, draft_vocab_size=64, steps=2, batch_size=4)
    one = _stage_dir(tmp_path / "one", small_cache, trained_target, **kw)
    two = _stage_dir(tmp_path / "two", small_cache, trained_target, **kw)
    train_one_and_two_ranks(one, two)
    a = load_file(one / "data" / "draft" / "model.safetensors")
    b = load_file(two / "data" / "draft" / "model.safetensors")
    assert torch.equal(a["d2t"], b["d2t"]) and torch.equal(a["t2d"], b["t2d"])


def _curve(work: Path):
    tsv = work / "data" / "train" / "live" / "plots" / "metrics" / "train" / "loss.tsv"
    rows = [line.split("\t") for line in tsv.read_text().splitlines()]
    col = rows[0].index("loss")
    return [float(r[col]) for r in rows[1:]]


# ---- EAGLE-3 ----------------------------------------------------------------------------------------------

def test_eagle3_trains_from_the_same_cache_with_a_reduced_vocabulary(tmp_path, small_cache, trained_target):
    from collections import Counter

    from deepspec.models.eagle3 import Eagle3Model

    cfg, final = train(tmp_path, small_cache, trained_target, algorithm="eagle3", ttt_steps=3, draft_vocab_size=64,
                       batch_size=8, steps=30)
    curve = losses(tmp_path)
    assert sum(curve[-5:]) / 5 < 0.8 * sum(curve[:3]) / 3
    draft = load_draft(tmp_path / "draft")
    assert isinstance(draft, Eagle3Model) and draft.config.target_layers == [-1, 0, 2]
    assert draft.config.block_size == draft.config.num_drafts == 3 and draft.config.draft_vocab_size == 64
    assert draft.layers[0].self_attn.q_proj.weight.shape[1] == 2 * draft.config.hidden_size       # [emb ; hidden]
    assert not hasattr(draft.layers[0].self_attn, "q_norm")                                       # Llama-shaped
    # the draft vocabulary = the 64 most frequent loss tokens of the cache
    data = TargetCacheDataset(str(small_cache), layers=[], fields=("input_ids", "loss_mask"))
    counts = Counter()
    for i in range(len(data)):
        counts.update(data[i]["input_ids"][data[i]["loss_mask"].bool()].tolist())
    ids = draft.draft_ids().tolist()
    assert ids == sorted(ids) and len(set(ids)) == 64 and draft.t2d.sum() == 64 and draft.t2d[ids].all()
    top = sorted(counts, key=lambda t: (-counts[t], t))[:64]
    assert set(top) <= set(ids) if len(counts) >= 64 else set(counts) <= set(ids)
    assert min(counts[t] for t in ids if t in counts) >= max((counts[t] for t in counts if t not in ids), default=0)
    # the draft head starts from (and trains away from) the target's rows; embeddings stay frozen
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(trained_target)
    assert torch.equal(draft.embed_tokens.weight, target.get_input_embeddings().weight)
    assert not torch.equal(draft.lm_head.weight, target.get_output_embeddings().weight[ids])


def test_eagle3_training_unrolls_ttt_steps_on_every_supervised_position(small_cache, trained_target):
    """Step k of row t predicts token t+2+k; it counts while every label up to it is a loss token."""
    from deepspec.models.eagle3 import eagle3_weights

    batch = collate([TargetCacheDataset(str(small_cache), layers=[-1, 0, 2])[i] for i in range(2)])
    w = eagle3_weights(batch, 3, 1e9)
    lm = batch["loss_mask"].bool()
    for b in range(2):
        n = int(batch["lengths"][b])
        for t in range(n - 1):
            for k in range(3):
                expect = all(t + 2 + j < n and lm[b, t + 2 + j] for j in range(k + 1))
                assert bool(w[b, t, k]) == expect, (b, t, k)
    assert w.sum() > 0


def test_eagle3_layers_default_and_must_be_three():
    from deepspec.config import ConfigError
    from deepspec.params import params_from_dict

    p = params_from_dict({"train": {"algorithm": "eagle3"}})
    assert p.train_layers == [1, 17, 33]                  # lowest, middle, highest of [1, 9, 17, 25, 33]
    assert params_from_dict({"layers": [9, 25, 2, 5], "train": {"algorithm": "eagle3"}}).train_layers == [2, 9, 25]
    assert params_from_dict({"train": {"algorithm": "eagle3", "layers": [9, 25, 33]}}).train_layers == [9, 25, 33]
    with pytest.raises(ConfigError, match="exactly three"):
        params_from_dict({"train": {"algorithm": "eagle3", "layers": [9, 25]}})
    with pytest.raises(ConfigError, match="exactly three"):
        params_from_dict({"layers": [9, 25], "train": {"algorithm": "eagle3"}})
    assert params_from_dict({"train": {"layers": [9, 25]}}).train_layers == [9, 25]  # other algorithms: any subset


def test_distinct_token_ids_are_every_id_the_cache_holds(small_cache):
    from deepspec.cache.read.reader import CacheReader
    from deepspec.loader.dataset import TargetCacheDataset
    from deepspec.train.run import distinct_token_ids

    reader = CacheReader(str(small_cache))
    every = np.unique(np.concatenate([reader.read(i, layers=[], fields=("input_ids",))["input_ids"]
                                      for i in range(len(reader))]))
    got = distinct_token_ids(TargetCacheDataset(str(small_cache), layers=[], fields=("input_ids",)))
    assert np.array_equal(got, every) and len(got) > 10


def test_eagle3_loss_over_target_chunks_equals_the_whole_vocabulary_at_once(small_cache, trained_target, monkeypatch):
    import deepspec.models.eagle3 as eagle3
    from deepspec.config import TrainConfig
    from deepspec.train.run import new_draft

    data = TargetCacheDataset(str(small_cache), layers=[-1, 0, 2], fields=("input_ids", "loss_mask"))
    counts = eagle3.loss_token_counts(data)
    model = new_draft(TrainConfig(algorithm="eagle3", ttt_steps=3, draft_vocab_size=64), [-1, 0, 2],
                      trained_target, counts)
    batch = collate([TargetCacheDataset(str(small_cache), layers=[-1, 0, 2])[i] for i in range(4)])
    monkeypatch.setattr(eagle3, "TARGET_CHUNK_ROWS", 1 << 30)
    whole = eagle3.eagle3_loss(model, batch, 1.0, 1.0, 4.0)
    monkeypatch.setattr(eagle3, "TARGET_CHUNK_ROWS", 7)  # many chunks, a short last one
    chunked = eagle3.eagle3_loss(model, batch, 1.0, 1.0, 4.0)
    assert torch.allclose(whole.loss, chunked.loss, rtol=1e-6, atol=1e-7)
    assert whole.metrics.keys() == chunked.metrics.keys()
    for key, value in whole.metrics.items():
        assert float(chunked.metrics[key]) == pytest.approx(float(value), rel=1e-6, abs=1e-7, nan_ok=True), key
    # the pieces themselves: the target's mass on the draft vocabulary and its argmax
    head, ids = model.verifier_head, model.draft_ids()
    x = batch["last_hidden"].reshape(-1, batch["last_hidden"].shape[-1])[:50].to(head.dtype)
    p = torch.nn.functional.linear(x, head).float().softmax(-1)
    got, top = eagle3.target_on_draft_vocab(x, head, ids, chunk_rows=8)
    assert torch.allclose(got, p[:, ids], atol=1e-7) and torch.equal(top, p.argmax(-1))


@pytest.mark.parametrize("algorithm", ["dspark", "dflash", "eagle3"])
def test_every_trainable_parameter_gets_a_gradient_so_ddp_needs_no_unused_search(tmp_path, small_cache, trained_target,
                                                                                algorithm):
    """DDP runs with find_unused_parameters=False (train/run.py): that holds only while every trainable
    parameter of every algorithm takes part in the loss, with or without the confidence term."""
    from deepspec.models.objectives import anchor_generator, sample_anchors
    from deepspec.train.run import build_trainer

    for conf_weight in (1.0, 0.0):
        cfg = TrainConfig(**dict(FAST, algorithm=algorithm, steps=1, conf_weight=conf_weight, ttt_steps=2,
                                 draft_vocab_size=64))
        trainer = build_trainer(cfg, [-1, 0, 2], str(small_cache), trained_target, tmp_path / "out",
                                tmp_path / f"state{conf_weight}")
        batch = next(trainer.batches())
        anchors = sample_anchors(batch["loss_mask"], batch["lengths"], cfg.anchors_per_sample,
                                 anchor_generator(cfg.seed, 0, 0, 0))
        trainer.module(batch, anchors, cfg.ce_weight, cfg.l1_weight, cfg.conf_weight, cfg.decay_gamma,
                       norm=1.0).loss.backward()
        trainable = [n for n, p in trainer.model.named_parameters() if p.requires_grad]
        assert trainable and [n for n, p in trainer.model.named_parameters() if p.requires_grad and p.grad is None] == []
        # a micro-batch with nothing supervised: a zero loss that still reaches every parameter
        trainer.model.zero_grad(set_to_none=True)
        empty = dict(batch, loss_mask=torch.zeros_like(batch["loss_mask"]))
        anchors = sample_anchors(empty["loss_mask"], empty["lengths"], cfg.anchors_per_sample,
                                 anchor_generator(cfg.seed, 0, 0, 0))
        out = trainer.module(empty, anchors, cfg.ce_weight, cfg.l1_weight, cfg.conf_weight, cfg.decay_gamma, norm=1.0)
        out.loss.backward()
        assert float(out.loss.detach()) == 0.0
        assert all(p.grad is not None and not p.grad.any() for p in trainer.model.parameters() if p.requires_grad)


@pytest.mark.parametrize("autocast", [False, True])
def test_eagle3_keeps_or_recomputes_the_targets_distribution_with_the_same_loss_and_gradients(
        small_cache, trained_target, monkeypatch, autocast):
    """Kept, the target's [rows, V] product runs once per chunk; recomputed, again in backward; the loss
    and every gradient are the same bits. Under autocast the target's head is cast to bf16 once, not
    at every product."""
    import copy

    import deepspec.models.eagle3 as eagle3
    from deepspec.train.run import new_draft

    data = TargetCacheDataset(str(small_cache), layers=[-1, 0, 2], fields=("input_ids", "loss_mask"))
    model = new_draft(TrainConfig(algorithm="eagle3", ttt_steps=3, draft_vocab_size=64), [-1, 0, 2],
                      trained_target, eagle3.loss_token_counts(data))
    batches = [collate([TargetCacheDataset(str(small_cache), layers=[-1, 0, 2])[i] for i in (a, a + 1)])
               for a in (0, 2)]
    monkeypatch.setattr(eagle3, "TARGET_CHUNK_ROWS", 16)
    head_shape, real = tuple(model.verifier_head.shape), eagle3.target_on_draft_vocab
    got = {}
    for keep in (True, False):
        monkeypatch.setattr(eagle3, "keeps_target_terms", lambda vd, i, keep=keep: keep)
        m, products, casts = copy.deepcopy(model), [], []
        monkeypatch.setattr(eagle3, "target_on_draft_vocab", lambda *a, **k: products.append(1) or real(*a, **k))

        class HeadCasts(torch.utils._python_dispatch.TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if func is torch.ops.aten._to_copy.default and tuple(args[0].shape) == head_shape:
                    casts.append(1)
                return func(*args, **(kwargs or {}))

        losses = []
        with HeadCasts(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            for batch in batches:
                out = eagle3.eagle3_loss(m, batch, 1.0, 1.0, 4.0)
                out.loss.backward()
                losses.append(out.loss.detach())
        chunks = sum(-(-int(eagle3._eagle3_valid(b, 3)[:, :, k].sum()) // 16) for b in batches for k in range(3))
        assert len(products) == (chunks if keep else 2 * chunks) and chunks > len(batches) * 3
        assert len(casts) == (1 if autocast else 0)
        got[keep] = losses, {n: p.grad for n, p in m.named_parameters() if p.requires_grad}
    assert all(torch.equal(a, b) for a, b in zip(got[True][0], got[False][0]))
    assert got[True][1].keys() == got[False][1].keys()
    assert all(torch.equal(got[True][1][n], got[False][1][n]) for n in got[True][1])


class ScalarReads(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the device-to-host scalar reads (`.item()`, `float()`, `int()`, `bool()` of a tensor: all go
    through aten._local_scalar_dense, a device sync on CUDA) that deepspec's own code makes."""

    def __init__(self):
        super().__init__()
        self.sites: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            import traceback

            # the frame that asked: the innermost one outside the mode and torch's dispatch wrappers (a read
            # inside torch itself, the optimizer's step counter say, is torch's and never a device sync)
            machinery = (f"torch{os.sep}_compile.py", f"torch{os.sep}_dynamo{os.sep}", "_python_dispatch.py")
            caller = next(f for f in reversed(traceback.extract_stack()[:-1])
                          if not any(m in f.filename for m in machinery))
            if f"{os.sep}deepspec{os.sep}" in caller.filename:
                self.sites.append(f"{Path(caller.filename).name}:{caller.lineno}")
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("algorithm", ["dspark", "dflash"])
def test_a_steps_metrics_leave_the_device_once_per_optimizer_step(tmp_path, small_cache, trained_target, monkeypatch,
                                                                   algorithm):
    """No scalar read-back inside a step (the prefetcher's next copy then overlaps the compute): the
    step's metrics come back in one copy at its end, whatever grad_accum is."""
    from deepspec.train.run import build_trainer
    from deepspec.train.trainer import Trainer

    cfg = TrainConfig(**dict(FAST, algorithm=algorithm, steps=3, grad_accum=3))
    trainer = build_trainer(cfg, [-1, 0, 2], str(small_cache), trained_target, tmp_path / "out", tmp_path / "state")
    reads = []
    real = Trainer._read_metrics
    monkeypatch.setattr(Trainer, "_read_metrics", lambda self, *a: reads.append(1) or real(self, *a))
    batches = trainer.batches()
    trainer.module.train()
    with ScalarReads() as mode:
        metrics = [trainer.step(batches) for _ in range(cfg.steps)]
    assert mode.sites == [] and len(reads) == cfg.steps
    assert all(isinstance(m["loss"], float) and m["tau_greedy"] >= 1.0 for m in metrics)


class DataDependentReads(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the ops whose output size the host must read back from the device before it can go on
    (`nonzero`, and indexing or assigning through a bool mask, which runs a nonzero inside)."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        masks = args[1] if name in ("index", "index_put", "index_put_") and len(args) > 1 else ()
        if name in ("nonzero", "masked_select") or any(isinstance(i, torch.Tensor) and i.dtype == torch.bool
                                                      for i in masks if i is not None):
            self.count += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("algorithm", ["dspark", "eagle3"])
def test_a_micro_batch_finds_its_supervised_rows_with_one_read_back(tmp_path, small_cache, trained_target, algorithm):
    """Each selection of supervised rows gathers by indices found once (DSpark: once per micro-batch;
    EAGLE-3: once per chain step), not through a bool mask per tensor, each a device sync on CUDA."""
    from deepspec.models.objectives import anchor_generator, sample_anchors
    from deepspec.train.run import build_trainer

    cfg = TrainConfig(**dict(FAST, algorithm=algorithm, draft_vocab_size=64))
    layers = [-1, 0, 2]
    trainer = build_trainer(cfg, layers, str(small_cache), trained_target, tmp_path / "out", tmp_path / "state")
    batch = next(trainer.batches())
    anchors = sample_anchors(batch["loss_mask"], batch["lengths"], cfg.anchors_per_sample, anchor_generator(0, 0, 0, 0))
    with DataDependentReads() as reads:
        out = trainer.module(batch, anchors, cfg.ce_weight, cfg.l1_weight, cfg.conf_weight, cfg.decay_gamma)
        out.loss.backward()
    assert reads.count == (1 if algorithm == "dspark" else cfg.ttt_steps)


class LoadLog:
    """The trainer's dataset, appending the monotonic start time of every batch load (loader.batches
    asks for the reader once a batch) to a file, from any process."""

    def __init__(self, inner, path: Path):
        self.inner, self.path = inner, path

    def __getattr__(self, name):  # what Batches reads (layers, fields); not before unpickling sets inner
        if name in ("inner", "path") or name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.inner, name)

    def __len__(self):
        return len(self.inner)

    def reader_here(self):
        with open(self.path, "a") as f:
            f.write(f"{time.monotonic()}\n")
        return self.inner.reader_here()


@pytest.mark.parametrize("workers", [0, 1])
def test_with_a_loading_worker_the_next_batch_loads_while_the_step_runs(tmp_path, small_cache, trained_target, workers):
    """The trainer's own loader (DataLoader + Prefetcher): with num_workers >= 1 batch n+1 is read
    while step n computes; with none, only between steps. An order of events, not a speed."""
    from deepspec.train.run import build_trainer

    cfg = TrainConfig(**dict(FAST, batch_size=2, num_workers=workers))
    trainer = build_trainer(cfg, [-1, 0, 2], str(small_cache), trained_target, tmp_path / "out", tmp_path / "state")
    log = tmp_path / "loads.txt"
    trainer.dataset = LoadLog(trainer.dataset, log)
    batches, steps = trainer.batches(), []
    for _ in range(4):
        next(batches)
        start = time.monotonic()
        time.sleep(0.3)  # the step's compute
        steps.append((start, time.monotonic()))
    loads = [float(t) for t in log.read_text().split()]
    during = [s for s in loads if any(a < s < b for a, b in steps)]
    assert during if workers else not during


def test_window_parts_reads_the_cache_a_few_parts_at_a_time(tmp_path, small_cache, trained_target):
    """train.window_parts: the trainer's sampler visits the cache's parts `window_parts` at a time
    (what a part mirror of a remote store needs), every sample once an epoch."""
    from deepspec.train.run import build_trainer

    cfg = TrainConfig(**dict(FAST, batch_size=2, window_parts=1))
    trainer = build_trainer(cfg, [-1, 0, 2], str(small_cache), trained_target, tmp_path / "out", tmp_path / "state")
    parts = trainer.dataset.sample_parts()
    assert len(set(parts.tolist())) > 1  # the small cache has several parts
    order = [i for b in trainer.sampler.global_batches(0) for i in b]
    runs = [int(parts[i]) for k, i in enumerate(order) if k == 0 or parts[i] != parts[order[k - 1]]]
    assert len(runs) == len(set(runs))  # one part after another, each read whole
    assert len(order) >= len(parts) - cfg.batch_size and len(set(order)) == len(order)
