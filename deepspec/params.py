"""params.yaml read into the typed sections of deepspec.config: validated with pydantic against the
sections' field types (extra keys forbidden, no coercion of one type into another), every error said
as the file, the key path and the bad value; credentials refused (the file is committed).
"""
from __future__ import annotations

import dataclasses
import functools
import re
import typing
from pathlib import Path
from typing import Annotated, Any

import yaml
from pydantic import TypeAdapter, ValidationError

from deepspec.config import ConfigError, Params

# pydantic's error types, said the way this file's readers (and its tests) know them
MESSAGES = {"int_type": "expected an integer", "float_type": "expected a number", "bool_type": "expected true/false",
            "string_type": "expected a string", "list_type": "expected a list", "dict_type": "expected a mapping",
            "dataclass_type": "expected a mapping"}
BOUNDS = {"greater_than_equal": ("ge", ">="), "greater_than": ("gt", ">"), "less_than_equal": ("le", "<="),
          "less_than": ("lt", "<")}


def _key_path(loc: tuple) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part != "[key]":
            out += f".{part}" if out else str(part)
    return out


def _section_at(loc: tuple) -> type:
    """The type a key path leads to: a section's dataclass, or a leaf's type (lists, bounds, None stripped)."""
    cls: Any = Params
    for part in loc:
        if isinstance(part, str) and dataclasses.is_dataclass(cls):
            cls = typing.get_type_hints(cls)[part]
        while typing.get_origin(cls) in (list, Annotated) or typing.get_origin(cls) is typing.Union:
            cls = next(a for a in typing.get_args(cls) if a is not type(None))
    return cls


def _message(error: dict) -> str:
    loc, kind, value = error["loc"], error["type"], error.get("input")
    path = _key_path(loc)
    if kind == "value_error":  # a section's own check (__post_init__): its message starts at the section
        why = str(error["ctx"]["error"])
        return f"{path}.{why}" if path else why
    if kind == "unexpected_keyword_argument":
        known = sorted(f.name for f in dataclasses.fields(_section_at(loc[:-1])))
        return f"{path}: unknown key (known: {known})"
    if kind in BOUNDS:
        name, sym = BOUNDS[kind]
        return f"{path}: must be {sym} {error['ctx'][name]}, got {value!r}"
    if kind == "literal_error":
        return f"{path}: {value!r} is not one of {list(typing.get_args(_section_at(loc)))}"
    if kind in MESSAGES:
        return f"{path or 'params'}: {MESSAGES[kind]}, got {value!r}"
    return f"{path or 'params'}: {error['msg']}, got {value!r}"


# how pydantic tags each member of a union a value failed (`compile: true | auto`)
UNION_MEMBER = re.compile(r"^(bool|int|float|str|none|literal\[.*\]|list\[.*\]|dict\[.*\])$")


def _messages(errors: list[dict]) -> list[str]:
    """One message per bad key: the errors of a union's members become one, naming each form the key
    takes ("train.compile: expected true/false or 'auto', got 'yes'")."""
    out, unions = [], {}
    for err in errors:
        loc = err["loc"]
        if loc and isinstance(loc[-1], str) and UNION_MEMBER.match(loc[-1]):
            unions.setdefault(loc[:-1], []).append(err)
        else:
            out.append(_message(err))
    for loc, errs in unions.items():
        forms = []
        for err in errs:
            kind = err["type"]
            if kind == "literal_error":
                forms.append(str(err["ctx"]["expected"]))
            elif kind in BOUNDS:
                name, sym = BOUNDS[kind]
                forms.append(f"must be {sym} {err['ctx'][name]}")
            else:
                forms.append(MESSAGES.get(kind, err["msg"]))
        out.append(f"{_key_path(loc)}: {' or '.join(forms)}, got {errs[0].get('input')!r}")
    return out


@functools.cache
def _validator() -> TypeAdapter:
    return TypeAdapter(Params)


# keys of fsspec/s3fs/gcsfs/adlfs options (and of botocore's client kwargs) that carry a credential
CREDENTIAL_KEYS = re.compile(r"(^|_)(key|secret|token|password|passwd|credentials?|account_key|sas_token|"
                             r"connection_string|access_key_id|secret_access_key|session_token)$", re.IGNORECASE)
NOT_CREDENTIALS = {"sse_kms_key_id", "ssekmskeyid"}  # names of keys that are not secrets themselves


def _credentials(value: Any, path: str) -> list[str]:
    found = []
    if isinstance(value, dict):
        for k, v in value.items():
            where = f"{path}.{k}"
            if isinstance(k, str) and CREDENTIAL_KEYS.search(k) and k.lower() not in NOT_CREDENTIALS and v:
                found.append(where)
            found += _credentials(v, where)
    elif isinstance(value, list):
        for i, v in enumerate(value):
            found += _credentials(v, f"{path}[{i}]")
    return found


def refuse_secrets(params: Params) -> None:
    """params.yaml is committed and every stage's params are copied into dvc.lock: a credential there
    ends up in git. Refused, with where it belongs instead."""
    found = _credentials(params.cache.storage_options, "cache.storage_options") + \
        _credentials(params.train.state_storage_options, "train.state_storage_options")
    if found:
        raise ConfigError(f"{', '.join(found)}: a credential in params.yaml would be committed (and copied into "
                          "dvc.lock); set it in the environment (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, "
                          "AWS_SESSION_TOKEN, or a profile: AWS_PROFILE) or for DVC in .dvc/config.local")
    for i, url in enumerate(params.regen.urls):
        if "@" in url.split("://", 1)[-1].split("/", 1)[0]:
            raise ConfigError(f"regen.urls[{i}]: user info in a server URL would be committed (and copied into "
                              f"dvc.lock); put the key in the environment variable regen.api_key_env names "
                              f"({params.regen.api_key_env})")


def params_from_dict(raw: Any) -> Params:
    try:
        params = _validator().validate_python({} if raw is None else raw)
    except ValidationError as e:
        raise ConfigError("; ".join(_messages(e.errors()))) from None
    refuse_secrets(params)
    return params


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
