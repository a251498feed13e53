"""What a target layer id means to each engine, and the conversions the export applies.

deepspec (cache, draft config): id i = the OUTPUT of decoder layer i (what `output_hidden_states[i + 1]`
    holds), -1 = the embedding output. The final layer is never an aux id (the draft trains against
    the post-norm last hidden state instead).
speculators (vLLM): id i = hidden_states[i] = the INPUT of decoder layer i, so the output of layer
    i-1; 0 = the embedding output. Convert with i + 1 (-1 -> 0).
dflash package and sglang's DFlash: id i = the OUTPUT of decoder layer i, read as hidden_states[i + 1]
    (`dflash.model.extract_context_feature`); sglang accepts 0 .. num_layers-1 only, so the
    embedding output (-1) has no dflash id. Unchanged.
sglang's EAGLE-3 (`eagle_config.eagle_aux_hidden_state_layer_ids` of a LlamaForCausalLMEagle3 draft):
    id i = the OUTPUT of decoder layer i: the target captures the input of layer i + 1 (sglang adds
    the 1 itself, `set_eagle3_layers_to_capture`). Unchanged; -1 is refused (sglang would capture the
    input of layer 0, a case its EAGLE-3 drafts do not use and this project cannot check). With no ids
    written sglang falls back to capturing the inputs of layers 2, n/2, n-3, so ids are always written.
speculators' EAGLE-3 (`eagle_aux_hidden_state_layer_ids`) counts like its DSpark/DFlash ids: i + 1.
"""
from __future__ import annotations


class NoSuchLayerId(ValueError):
    """An id the engine's convention cannot express."""


def to_speculators(ids: list[int]) -> list[int]:
    return [i + 1 for i in ids]


def from_speculators(ids: list[int]) -> list[int]:
    return [i - 1 for i in ids]


def _outputs_only(ids: list[int], engine: str) -> list[int]:
    """Engines whose ids are layer outputs 0 .. num_layers-1 (this project's convention without -1)."""
    if any(i < 0 for i in ids):
        raise NoSuchLayerId(f"layers {ids} include -1 (the embedding output), which {engine} "
                            "cannot name (its ids are layer outputs 0 .. num_layers-1)")
    return list(ids)


def to_dflash(ids: list[int]) -> list[int]:
    return _outputs_only(ids, "the dflash layout")


def from_dflash(ids: list[int]) -> list[int]:
    return list(ids)


def to_sglang_eagle3(ids: list[int]) -> list[int]:
    return _outputs_only(ids, "sglang's EAGLE-3 layout")


def from_sglang_eagle3(ids: list[int]) -> list[int]:
    return list(ids)
