"""Conversation -> (input_ids, loss_mask) through the target tokenizer's own chat template.

The mask follows the reference definition: 1 on every assistant content token and on the
end-of-turn token that closes it, 0 elsewhere. Spans come from the tokenizer's offset mapping over
the rendered text (no re-tokenising of pieces), so anything a template adds around the content —
headers, an empty `<think></think>` block, Gemma-4's thought-channel prefix — stays out of the loss.
No system prompt is added unless the row has one.
"""
from __future__ import annotations

from dataclasses import dataclass


class TemplateError(ValueError):
    """A conversation that the chat template does not render verbatim."""


@dataclass
class Encoded:
    input_ids: list[int]
    loss_mask: list[int]
    truncated: bool


def _special_ids(tokenizer) -> set[int]:
    ids = set(tokenizer.all_special_ids)
    ids.update(tokenizer.added_tokens_decoder.keys())
    return ids


def render(tokenizer, turns: list[dict], **template_kwargs) -> str:
    return tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=False,
                                         **template_kwargs)


def encode_conversation(tokenizer, turns: list[dict], max_length: int | None = None,
                        **template_kwargs) -> Encoded:
    text = render(tokenizer, turns, **template_kwargs)
    spans, pos = [], 0
    for i, turn in enumerate(turns):
        content = turn["content"].strip()
        at = text.find(content, pos)
        if at < 0:
            raise TemplateError(f"turn {i} ({turn['role']}): content not found verbatim in the "
                                "rendered chat template")
        if turn["role"] == "assistant":
            spans.append((at, at + len(content)))
        pos = at + len(content)

    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = enc["input_ids"], enc["offset_mapping"]
    special = _special_ids(tokenizer)
    mask = [0] * len(ids)
    j = 0  # tokens and spans are both in text order: one merge-like pass
    for start, end in spans:
        while j < len(ids) and offsets[j][1] <= start:
            j += 1
        while j < len(ids) and offsets[j][0] < end:
            mask[j] = 1
            j += 1
        if j < len(ids) and ids[j] in special:  # the end-of-turn token that closes this answer
            mask[j] = 1
            j += 1
    truncated = max_length is not None and len(ids) > max_length
    if truncated:
        ids, mask = ids[:max_length], mask[:max_length]
    return Encoded(list(ids), mask, truncated)


def encode_prompt(tokenizer, turns: list[dict], **template_kwargs) -> list[int]:
    """Token ids of a prompt that ends with the assistant header (generation prompt)."""
    text = tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=True,
                                         **template_kwargs)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])
