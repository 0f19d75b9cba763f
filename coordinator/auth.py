"""Client API keys: who may use the generation surfaces.

Owns: the configured keys (as SHA-256 digests, never the keys themselves after start-up), reading a
presented key from `Authorization: Bearer <key>` or `X-API-Key`, the constant-time check, and the
short key id (a hash prefix) that metrics count requests by. Must not: log or expose a key.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable, Mapping
from pathlib import Path


def key_id(key: str) -> str:
    """A short, stable, non-secret name for a key: metrics label requests with it."""
    return hashlib.sha256(key.encode()).hexdigest()[:8]


class ApiKeys:
    def __init__(self, keys: Iterable[str]) -> None:
        self._keys = [(key_id(k), hashlib.sha256(k.encode()).digest()) for k in dict.fromkeys(keys) if k]
        if not self._keys:
            raise ValueError("api_keys: no key given")

    @classmethod
    def from_setting(cls, value: str | None) -> ApiKeys | None:
        """`value`: a path to a file with one key per line (# comments allowed), or keys separated by
        commas; None or empty: no keys, every client is let in."""
        if not value:
            return None
        path = Path(value)
        if "," not in value and path.is_file():
            lines = (line.strip() for line in path.read_text().splitlines())
            return cls(line for line in lines if line and not line.startswith("#"))
        return cls(part.strip() for part in value.split(","))

    def __len__(self) -> int:
        return len(self._keys)

    def identify(self, headers: Mapping[str, str]) -> str | None:
        """The key id of the key the request presents, or None. Compares against every key, in
        constant time each, so timing tells neither which key nor how much of one matched."""
        presented = headers.get("x-api-key") or ""
        authorization = headers.get("authorization") or ""
        if not presented and authorization[:7].lower() == "bearer ":
            presented = authorization[7:].strip()
        digest = hashlib.sha256(presented.encode()).digest()
        found = None
        for kid, expected in self._keys:
            if hmac.compare_digest(digest, expected) and presented:
                found = kid
        return found
