"""Conversation -> (input_ids, loss_mask) through the target tokenizer's own chat template.

The mask follows the reference definition: 1 on every assistant content token and on the
end-of-turn token that closes it, 0 elsewhere. Spans come from the tokenizer's offset mapping over
the rendered text (no re-tokenising of pieces), so anything a template adds around the content —
headers, an empty `<think></think>` block, Gemma-4's thought-channel prefix — stays out of the loss.
No system prompt is added unless the row has one. Each content is located right after its own turn's
markup (found by rendering the conversation once more with markers as contents), so a short answer
such as `a` never matches inside a header.
"""
from __future__ import annotations

from dataclasses import dataclass


class TemplateError(ValueError):
    """A conversation that the chat template does not render verbatim."""


@dataclass
class Encoded:
    input_ids: list[int]
    loss_mask: list[int]
    truncated: bool         # the conversation was longer than max_length
    answers_kept: int = 0   # assistant turns whose answer (and end of turn) are in the tokens


def _special_ids(tokenizer) -> set[int]:
    ids = set(tokenizer.all_special_ids)
    ids.update(tokenizer.added_tokens_decoder.keys())
    return ids


def render(tokenizer, turns: list[dict], add_generation_prompt: bool = False, **template_kwargs) -> str:
    """The template's text; a conversation the template refuses (its `raise_exception`, e.g. Gemma's
    "roles must alternate") is a TemplateError carrying the template's own message."""
    from jinja2.exceptions import TemplateError as JinjaError

    try:
        return tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=add_generation_prompt,
                                             **template_kwargs)
    except JinjaError as e:
        raise TemplateError(f"the chat template refuses this conversation: {e}") from None


def _marker(i: int) -> str:
    return f"\u00a7DEEPSPEC-TURN-{i}\u00a7"


def turn_markup(tokenizer, turns: list[dict], **template_kwargs) -> list[str]:
    """The template's own text before each turn's content and after the last one (len(turns) + 1
    pieces): the same conversation rendered with a unique marker as every content, cut at the markers."""
    marked = render(tokenizer, [dict(t, content=_marker(i)) for i, t in enumerate(turns)], **template_kwargs)
    pieces, pos = [], 0
    for i, turn in enumerate(turns):
        at = marked.find(_marker(i), pos)
        if at < 0:
            raise TemplateError(f"turn {i} ({turn['role']}): the chat template does not render this turn's "
                                "content verbatim")
        pieces.append(marked[pos:at])
        pos = at + len(_marker(i))
    pieces.append(marked[pos:])
    return pieces


def _expect(text: str, what: str, pos: int) -> int:
    """Where `what` starts in `text` at `pos`, past whitespace a template left untrimmed; -1 if it does not."""
    at = text.find(what, pos)
    return at if at >= 0 and not text[pos:at].strip() else -1


def encode_conversation(tokenizer, turns: list[dict], max_length: int | None = None,
                        unfinished: frozenset[int] = frozenset(), overlong: str = "cut_turn",
                        **template_kwargs) -> Encoded:
    """`unfinished`: positions (among the assistant turns) of answers the target did not end (cut by
    max_tokens): their end-of-turn token, which the target never produced, gets no loss. A
    conversation over `max_length` tokens is cut after the last answer that fits, end of turn
    included (`overlong="cut_turn"`; nothing is left if the first answer does not fit), or cut at
    exactly `max_length` tokens (`"truncate"`, mid-answer)."""
    text = render(tokenizer, turns, **template_kwargs)
    # Walk the text markup, content, markup, content...: each answer is looked for only right after its
    # own turn's header, never inside markup ("a" is in "<|im_start|>").
    markup = turn_markup(tokenizer, turns, **template_kwargs)
    spans, pos = [], 0
    for i, turn in enumerate(turns):
        content = turn["content"].strip()
        head = _expect(text, markup[i], pos)
        at = _expect(text, content, head + len(markup[i])) if head >= 0 else -1
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
    ends = []  # the token position just past each answer (and its end of turn)
    for k, (start, end) in enumerate(spans):
        while j < len(ids) and offsets[j][1] <= start:
            j += 1
        while j < len(ids) and offsets[j][0] < end:
            mask[j] = 1
            j += 1
        if j < len(ids) and ids[j] in special:  # the end-of-turn token that closes this answer
            mask[j] = 0 if k in unfinished else 1
            j += 1
        ends.append(j)
    truncated = max_length is not None and len(ids) > max_length
    keep = len(ids)
    if truncated:
        keep = max_length if overlong == "truncate" else max((e for e in ends if e <= max_length), default=0)
    kept = sum(e <= keep for e in ends)
    return Encoded(list(ids[:keep]), mask[:keep], truncated, kept)


def encode_prompt(tokenizer, turns: list[dict], **template_kwargs) -> list[int]:
    """Token ids of a prompt that ends with the assistant header (generation prompt)."""
    text = render(tokenizer, turns, add_generation_prompt=True, **template_kwargs)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])
