"""What a target layer id means to each engine, and the conversions the export applies.

deepspec (cache, draft config): id i = the OUTPUT of decoder layer i (what `output_hidden_states[i + 1]`
    holds), -1 = the embedding output. The final layer is never an aux id (the draft trains against
    the post-norm last hidden state instead).
speculators (vLLM): id i = hidden_states[i] = the INPUT of decoder layer i, so the output of layer
    i-1; 0 = the embedding output. Convert with i + 1 (-1 -> 0).
dflash package and sglang's DFlash: id i = the OUTPUT of decoder layer i, read as hidden_states[i + 1]
    (`dflash.model.extract_context_feature`); sglang accepts 0 .. num_layers-1 only, so the
    embedding output (-1) has no dflash id. Unchanged.
"""
from __future__ import annotations


class NoSuchLayerId(ValueError):
    """An id the engine's convention cannot express."""


def to_speculators(ids: list[int]) -> list[int]:
    return [i + 1 for i in ids]


def from_speculators(ids: list[int]) -> list[int]:
    return [i - 1 for i in ids]


def to_dflash(ids: list[int]) -> list[int]:
    if any(i < 0 for i in ids):
        raise NoSuchLayerId(f"layers {ids} include -1 (the embedding output), which the dflash layout "
                            "cannot name (its ids are layer outputs 0 .. num_layers-1)")
    return list(ids)


def from_dflash(ids: list[int]) -> list[int]:
    return list(ids)
