"""The request's API key held to its limits (admission/limits.py): streams, requests and tokens a
minute, and its budget; every kind of request a key sends, generations and embeddings alike.

Owns: counting the request in when it enters (or its 429), and its tokens (prompt + generated) when
it leaves; one that never opened used none.
Must not: know tenants or requests beyond their key and their tokens.
"""

from __future__ import annotations

from coordinator.admission.limits import Limits
from coordinator.auth import Client
from coordinator.stages import End, Entry, W


class KeyLimitStage:
    def __init__(self, limits: Limits) -> None:
        self._limits = limits

    def enter(self, entry: Entry[W]) -> _Counted | None:
        client = entry.client
        if client is None or not client.limits.any:
            return None
        self._limits.admit(client.key_id, client.limits)
        return _Counted(self._limits, client)


class _Counted:
    __slots__ = ("_client", "_limits")

    def __init__(self, limits: Limits, client: Client) -> None:
        self._limits, self._client = limits, client

    def failed(self, exc: BaseException) -> None:
        self._limits.finished(self._client.key_id, self._client.limits, 0)

    def ended(self, end: End) -> None:
        self._limits.finished(self._client.key_id, self._client.limits, end.prompt_tokens + end.generated_tokens)
