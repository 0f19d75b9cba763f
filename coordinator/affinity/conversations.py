"""Conversation affinity for clients that resend the whole conversation each turn (the OpenAI API).

Owns: a bounded map from a conversation's fingerprint to the worker that served it, and the two
fingerprints: `conversation_key` of everything a request sent, and `continuation_key` of a next
turn, which is the previous request's key when the conversation went on as usual (the previous
messages, then the assistant's reply, then new user messages or the results of the reply's tool
calls).
Must not: force a worker. Unlike a `session_id`, a fingerprint is only a preference: the scheduler
puts that worker first when it passes every filter, because its freed sequence most likely still
holds the conversation's prefix in its KV cache, so the worker prefills only the new turn.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence

from protocol.worker import ChatMessage


def conversation_key(tenant: str, model: str | None, messages: Sequence[ChatMessage]) -> bytes:
    """A fingerprint of one tenant's conversation: another tenant's identical conversation is another key."""
    digest = hashlib.blake2b(digest_size=16)
    digest.update(f"{tenant}\0{model or ''}\0".encode())
    for m in messages:
        content = m.said().encode()
        digest.update(f"{m.role}:{len(content)}:".encode())
        digest.update(content)
    return digest.digest()


def continuation_key(tenant: str, model: str | None, messages: Sequence[ChatMessage]) -> bytes | None:
    """The key the previous turn was remembered under, if this request continues one."""
    reply = next((i for i in range(len(messages) - 1, -1, -1) if messages[i].role == "assistant"), 0)
    if reply == 0 or reply == len(messages) - 1 or any(m.role not in ("user", "tool") for m in messages[reply + 1:]):
        return None
    return conversation_key(tenant, model, messages[:reply])


class ConversationTable:
    def __init__(self, capacity: int) -> None:
        self._capacity = capacity
        self._worker_of: OrderedDict[bytes, str] = OrderedDict()

    def __len__(self) -> int:
        return len(self._worker_of)

    def worker_of(self, key: bytes) -> str | None:
        return self._worker_of.get(key)

    def remember(self, key: bytes, worker_id: str) -> None:
        if self._capacity <= 0:
            return
        self._worker_of[key] = worker_id
        self._worker_of.move_to_end(key)
        while len(self._worker_of) > self._capacity:
            self._worker_of.popitem(last=False)
