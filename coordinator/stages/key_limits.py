"""The request's API key held to its limits (admission/limits.py): streams, requests and tokens a
minute, and its budget; every kind of request a key sends, generations and embeddings alike.

Owns: counting the request in when it enters (or its 429), and its tokens (prompt + generated) when
it leaves; one that never opened used none.
Must not: know tenants or requests beyond their key and their tokens.
"""

from __future__ import annotations

from coordinator.admission.limits import Limits
from coordinator.stages import Entry, Leaving, W


class KeyLimitStage:
    def __init__(self, limits: Limits) -> None:
        self._limits = limits

    def enter(self, entry: Entry[W]) -> Leaving | None:
        client = entry.client
        if client is None or not client.limits.any:
            return None
        key_id, limits = client.key_id, client.limits
        self._limits.admit(key_id, limits)
        return Leaving(lambda _exc: self._limits.finished(key_id, limits, 0),
                       lambda end: self._limits.finished(key_id, limits, end.prompt_tokens + end.generated_tokens))
