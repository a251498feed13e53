import re
from pathlib import Path

import pytest
import yaml

from deepspec.config import ConfigError, ExportConfig, TrainConfig
from deepspec.params import load_params, params_from_dict

REPO = Path(__file__).resolve().parents[1]


def test_repo_params_load_with_reference_layers():
    p = load_params(REPO / "params.yaml")
    assert p.layers == [1, 9, 17, 25, 33]
    assert p.train_layers == p.layers
    assert p.sampling.max_tokens > 0
    # the export section and the new train keys: params.yaml states the dataclass defaults
    assert p.export == ExportConfig() and p.export.formats == ["speculators", "dflash", "sglang-eagle3"]
    assert (p.train.mask_token_id, p.train.sample_from_anchor) == (None, None)


@pytest.mark.parametrize("raw, message", [
    ({"split": {"sed": 1}}, "split.sed: unknown key"),
    ({"bogus": 1}, "bogus: unknown key"),
    ({"sampling": {"temperature": "hot"}}, "sampling.temperature: expected a number, got 'hot'"),
    ({"sampling": {"top_p": 1.5}}, "sampling.top_p: must be <= 1.0, got 1.5"),
    ({"sampling": {"max_tokens": 0}}, "sampling.max_tokens: must be >= 1, got 0"),
    ({"split": {"seed": True}}, "split.seed: expected an integer, got True"),
    ({"layers": [1, "x"]}, "layers[1]: expected an integer, got 'x'"),
    ({"layers": [1, 1]}, "layers: ids must be unique"),
    ({"layers": [-2]}, "layers: ids must be >= -1"),
    ({"cache": {"dtype": "float16"}}, "cache.dtype: 'float16' is not one of"),
    ({"target": {"tiny": {"num_layers": 1}}}, "target.tiny.num_layers: must be >= 2, got 1"),
    ({"train": {"layers": [9, 40]}}, "train.layers: [40] are not cached"),
    ({"split": 3}, "split: expected a mapping, got 3"),
    ({"train": {"mask_token_id": -2}}, "train.mask_token_id: must be >= -1, got -2"),
    ({"train": {"sample_from_anchor": "yes"}}, "train.sample_from_anchor: expected true/false, got 'yes'"),
    ({"export": {"formats": ["vllm"]}}, "export.formats[0]: 'vllm' is not one of"),
    ({"export": {"formats": ["dflash", "dflash"]}}, "export.formats: listed twice"),
    # no coercion: a quoted number, a float for an integer, yes/no for a boolean are what YAML says they are
    ({"train": {"lr": "0.001"}}, "train.lr: expected a number, got '0.001'"),
    ({"train": {"steps": 10.0}}, "train.steps: expected an integer, got 10.0"),
    ({"eval": {"sample": "no"}}, "eval.sample: expected true/false, got 'no'"),
    ({"regen": {"urls": [8000]}}, "regen.urls[0]: expected a string, got 8000"),
    ({"train": {"adam_betas": [0.9]}}, "train.adam_betas: "),
    ({"train": {"adam_betas": [0.9, 1.0]}}, "train.adam_betas[1]: must be < 1.0, got 1.0"),
    ({"train": {"adam_eps": 0.0}}, "train.adam_eps: must be > 0.0, got 0.0"),
    ({"train": {"compile": "yes"}}, "train.compile: expected true/false or 'auto', got 'yes'"),
])
def test_bad_params_name_key_and_value(raw, message):
    with pytest.raises(ConfigError) as e:
        params_from_dict(raw)
    assert message in str(e.value)


def test_error_names_the_file(tmp_path):
    f = tmp_path / "params.yaml"
    f.write_text(yaml.safe_dump({"sampling": {"top_k": -1}}))
    with pytest.raises(ConfigError, match=r"params.yaml: sampling.top_k: must be >= 0, got -1"):
        load_params(f)
    with pytest.raises(ConfigError, match="file not found"):
        load_params(tmp_path / "missing.yaml")


def test_every_bad_key_is_named_at_once(tmp_path):
    f = tmp_path / "params.yaml"
    f.write_text(yaml.safe_dump({"sampling": {"top_k": -1, "top_p": 0}, "train": {"stpes": 5}}))
    with pytest.raises(ConfigError) as e:
        load_params(f)
    assert [m.strip() for m in str(e.value).split(";")] == [
        f"{f}: sampling.top_p: must be > 0.0, got 0", "sampling.top_k: must be >= 0, got -1",
        "train.stpes: unknown key (known: " + str(sorted(TrainConfig.__dataclass_fields__)) + ")"]


def test_train_layer_subset_and_int_to_float():
    p = params_from_dict({"layers": [9, 25], "train": {"layers": [25], "lr": 1}})
    assert p.train_layers == [25]
    assert isinstance(p.train.lr, float)


def _leaves(raw, default, path=""):
    """(key path, params.yaml value, dataclass default) for every leaf key params.yaml sets."""
    import dataclasses

    for key, value in raw.items():
        here = f"{path}.{key}" if path else key
        assert hasattr(default, key), f"{here}: in params.yaml but not a field of {type(default).__name__}"
        sub = getattr(default, key)
        if dataclasses.is_dataclass(sub):
            yield from _leaves(value, sub, here)
        else:
            yield here, value, sub


def test_params_yaml_equals_the_dataclass_defaults():
    """One source of truth: params.yaml spells out the defaults, it never overrides them."""
    from deepspec.config import Params

    import functools

    raw = yaml.safe_load((REPO / "params.yaml").read_text())
    parsed = params_from_dict(raw)  # lists of sections (eval.suites) compare as the dataclasses they parse to
    drift = [f"{key}: params.yaml {value!r} != default {default!r}"
             for key, value, default in _leaves(raw, Params())
             if functools.reduce(getattr, key.split("."), parsed) != default]
    assert drift == []


def test_sampling_defaults_are_qwen3_non_thinking():
    """The reference pipeline's and Qwen3's recommended non-thinking sampling."""
    from deepspec.config import SamplingConfig

    s = SamplingConfig()
    assert (s.temperature, s.top_p, s.top_k, s.min_p) == (0.7, 0.8, 20, 0.0)


@pytest.mark.parametrize("options,field", [
    ({"key": "AKIA0000", "secret": "s3cr3t"}, "cache.storage_options.key"),
    ({"client_kwargs": {"aws_secret_access_key": "s3cr3t"}}, "cache.storage_options.client_kwargs.aws_secret_access_key"),
    ({"token": "t0ken"}, "cache.storage_options.token"),
    ({"account_key": "azure"}, "cache.storage_options.account_key"),
])
def test_credentials_in_storage_options_are_refused_pointing_to_the_environment(tmp_path, options, field):
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump({"cache": {"url": "s3://bucket/lake", "storage_options": options}}))
    with pytest.raises(ConfigError, match=re.escape(field)) as e:
        load_params(path)
    assert "AWS_SECRET_ACCESS_KEY" in str(e.value) and ".dvc/config.local" in str(e.value)
    assert "s3cr3t" not in str(e.value) and "t0ken" not in str(e.value)


def test_storage_options_without_credentials_load():
    params = params_from_dict({"cache": {"storage_options": {"endpoint_url": "https://s3.example",
                                                             "profile": "team", "s3_additional_kwargs":
                                                             {"SSEKMSKeyId": "alias/lake"}, "anon": False}}})
    assert params.cache.storage_options["profile"] == "team"


def test_a_server_url_with_user_info_is_refused_and_never_logged():
    from deepspec.data.chat_client import Endpoint

    with pytest.raises(ConfigError, match=r"regen.urls\[1\].*OPENAI_API_KEY") as e:
        params_from_dict({"regen": {"backend": "openai", "urls": ["http://a:30000", "http://me:pw@b:30000"]}})
    assert "pw" not in str(e.value)
    assert Endpoint("http://me:pw@b:30000", "m").shown == "http://***@b:30000"
    assert Endpoint("http://b:30000", "m").shown == "http://b:30000"
