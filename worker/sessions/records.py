"""Stored responses: the records of the Responses API's `store: true` answers, kept by the worker that
ran them, next to the session that holds their conversation's KV.

Owns: the records, each an opaque JSON object the coordinator made (the response, its conversation as
input items, the session its KV lives in), keyed by (tenant, response id); their bounds, per tenant in
count and bytes and for all tenants in a TTL (settings `responses_per_tenant`, `responses_bytes_per_tenant`,
`responses_ttl`): past a bound the tenant's oldest record goes first, one over a bound on its own is
refused; and who may read one: only its tenant (another tenant's id names nothing, as for sessions).
Must not: read or shape what a record says (the coordinator does), or hold KV (the session table does).

Why here and not in a coordinator: a chain's next turn must go where its KV is, through any coordinator,
after any coordinator's restart; the worker holding that KV is the one place every coordinator reaches
and none owns. A record outlives its conversation's KV on purpose (a turn on it is then prefilled whole,
elsewhere if need be); a drain hands it over (`take`) for a coordinator to move; a crash loses it (a
continuation then gets `previous_response_not_found`).
Per worker and per process, not per model: a model swap keeps them.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

Key = tuple[str, str]  # (tenant, response id)


@dataclass(frozen=True, slots=True)
class Record:
    body: bytes  # the coordinator's JSON object, as it sent it
    stored_at: float


class TooLarge(ValueError):
    """A record over its tenant's byte bound on its own: kept it would leave the tenant nothing else."""


class Records:
    """`Records(per_tenant=..., bytes_per_tenant=..., ttl=..., clock=...)`; `put`, `get`, `delete`,
    `sweep`. Not thread-safe: the event loop alone uses it."""

    def __init__(self, *, per_tenant: int, bytes_per_tenant: int, ttl: float, clock: Callable[[], float]) -> None:
        self._per_tenant = per_tenant
        self._bytes_per_tenant = bytes_per_tenant
        self._ttl = ttl
        self._clock = clock
        self._tenants: dict[str, OrderedDict[str, Record]] = {}  # each oldest first
        self._bytes: dict[str, int] = {}
        self.taken_at = float("-inf")  # clock time of the last `take` (a drain waits while they are taken)

    def __len__(self) -> int:
        return sum(len(kept) for kept in self._tenants.values())

    def usage(self, tenant: str) -> tuple[int, int]:
        """(records, bytes) the tenant holds here now."""
        return len(self._tenants.get(tenant, ())), self._bytes.get(tenant, 0)

    def fits(self, body: bytes) -> None:
        """Raises `TooLarge` for a body over a tenant's byte bound on its own."""
        if len(body) > self._bytes_per_tenant:
            raise TooLarge(f"a record of {len(body)} bytes, over the {self._bytes_per_tenant} a tenant may store "
                           "(WORKER_RESPONSES_BYTES_PER_TENANT)")

    def put(self, key: Key, body: bytes) -> None:
        """Keep `body` under `key` (replacing one kept there), the tenant's oldest going first past a
        bound; raises `TooLarge` for a body over the tenant's byte bound on its own."""
        tenant, response_id = key
        self.fits(body)
        self.delete(key)
        kept = self._tenants.setdefault(tenant, OrderedDict())
        while kept and (len(kept) >= self._per_tenant or self._bytes[tenant] + len(body) > self._bytes_per_tenant):
            self.delete((tenant, next(iter(kept))))
            kept = self._tenants.setdefault(tenant, OrderedDict())
        kept[response_id] = Record(body, self._clock())
        self._bytes[tenant] = self._bytes.get(tenant, 0) + len(body)

    def get(self, key: Key) -> Record | None:
        tenant, response_id = key
        kept = self._tenants.get(tenant)
        record = kept.get(response_id) if kept is not None else None
        if record is None or self._clock() - record.stored_at > self._ttl:
            return None
        return record

    def delete(self, key: Key) -> bool:
        tenant, response_id = key
        kept = self._tenants.get(tenant)
        record = kept.pop(response_id, None) if kept is not None else None
        if record is None:
            return False
        self._bytes[tenant] -= len(record.body)
        if not kept:
            del self._tenants[tenant], self._bytes[tenant]
        return True

    def take(self, max_bytes: int) -> list[tuple[Key, Record]]:
        """Hand records over (a drain: a coordinator puts them on other workers): each tenant's oldest
        first, up to `max_bytes` (at least one), forgotten here as they are taken."""
        self.taken_at = self._clock()
        taken: list[tuple[Key, Record]] = []
        size = 0
        for tenant, kept in list(self._tenants.items()):
            for response_id, record in list(kept.items()):
                if taken and size + len(record.body) > max_bytes:
                    return taken
                taken.append(((tenant, response_id), record))
                size += len(record.body)
                self.delete((tenant, response_id))
        return taken

    def sweep(self) -> int:
        """Forget the records past their TTL; how many went."""
        cutoff = self._clock() - self._ttl
        gone = 0
        for tenant, kept in list(self._tenants.items()):
            for response_id, record in list(kept.items()):
                if record.stored_at >= cutoff:
                    break  # oldest first: the rest are younger
                self.delete((tenant, response_id))
                gone += 1
        return gone
