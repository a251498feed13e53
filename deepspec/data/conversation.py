"""Normalise Open-PerfectBlend rows into `[{role, content}]` conversations, or say why not."""
from __future__ import annotations

import hashlib

from deepspec.io import canonical_json

ROLES = {
    "human": "user", "user": "user",
    "gpt": "assistant", "chatgpt": "assistant", "bing": "assistant", "bard": "assistant",
    "assistant": "assistant",
    "system": "system",
}


class RowRejected(ValueError):
    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail


def normalize_conversation(row: dict, leading_assistant: str = "reject", notes: list[str] | None = None) -> list[dict]:
    """Return `[{role, content}]`: optional system turn, then user/assistant alternating from user.
    The turns are the row's `conversations` (ShareGPT, `{from, value}` or `{role, content}`) or its
    `messages` (OpenAI style). Assistant turns before the first user turn (a greeting some dumps
    open with) are dropped with `leading_assistant="drop_turn"` (noted in `notes`), else rejected."""
    key = "conversations" if "conversations" in row else "messages" if "messages" in row else None
    if key is None:
        raise RowRejected("missing_conversations", f"keys: {sorted(row)[:8]}")
    conv = row[key]
    if not isinstance(conv, list) or not conv:
        raise RowRejected("empty_conversations" if isinstance(conv, list) else "conversations_not_list",
                          type(conv).__name__)
    turns = []
    for i, turn in enumerate(conv):
        if not isinstance(turn, dict):
            raise RowRejected("turn_not_object", f"turn {i}: {type(turn).__name__}")
        raw_role = turn.get("from", turn.get("role"))
        if not isinstance(raw_role, str) or raw_role.strip().lower() not in ROLES:
            raise RowRejected("unknown_role", f"turn {i}: {raw_role!r}")
        content = turn.get("value", turn.get("content"))
        if not isinstance(content, str):
            raise RowRejected("non_string_content", f"turn {i}: {type(content).__name__}")
        if not content.strip():
            raise RowRejected("empty_content", f"turn {i}")
        turns.append({"role": ROLES[raw_role.strip().lower()], "content": content})
    body = turns[1:] if turns[0]["role"] == "system" else turns
    if any(t["role"] == "system" for t in body):
        raise RowRejected("misplaced_system", "a system turn after the first turn")
    if not body:
        raise RowRejected("no_user_turn", "only a system turn")
    if body[0]["role"] != "user":
        if leading_assistant != "drop_turn":
            raise RowRejected("starts_with_assistant", "first non-system turn is from the assistant")
        lead = next((i for i, t in enumerate(body) if t["role"] == "user"), None)
        if lead is None:
            raise RowRejected("no_user_turn", "only assistant turns")
        turns = turns[:len(turns) - len(body)] + body[lead:]
        body = body[lead:]
        if notes is not None:
            notes.append("dropped_leading_assistant")
    for i, t in enumerate(body):
        expected = "user" if i % 2 == 0 else "assistant"
        if t["role"] != expected:
            raise RowRejected("not_alternating", f"turn {i + len(turns) - len(body)}: two {t['role']} turns in a row")
    return turns


def conversation_id(turns: list[dict]) -> str:
    """Content-derived id: the same conversation gets the same id on every machine and every run."""
    return hashlib.sha256(canonical_json(turns).encode()).hexdigest()[:16]


def normalize_prompt(text: str) -> str:
    """Case- and whitespace-insensitive form of a prompt, for telling repeated prompts apart."""
    return " ".join(text.casefold().split())


def user_turns(turns: list[dict]) -> list[str]:
    return [t["content"] for t in turns if t["role"] == "user"]


def system_prompt(turns: list[dict]) -> str | None:
    return turns[0]["content"] if turns and turns[0]["role"] == "system" else None
