"""How long a model of the folder stays loaded once idle: the operator's to decide, which tenants'
requests may only lengthen (issue 50).

Owns: each tenant's own stay (its latest request's `keep_alive`, Ollama's, from its last use: a later
request of the same tenant replaces it, 0 withdrawing it), the operator's bounds on them
(WORKER_KEEP_ALIVE_MAX: the longest a request may ask for; a negative one pins the model only where that
setting is negative too), and the answer the swapper's keep-alive reads: how long the model may stay idle
before it is unloaded, the longest of the operator's WORKER_KEEP_ALIVE and every tenant's stay still
running. So no request unloads a model another tenant used within its keep-alive: before, one tenant's
`keep_alive: 0` unloaded the model another was using (its next chat a cold load: 1.29 s, not 0.05 s),
and its `-1` pinned it for good.
Must not: unload anything (worker/slots/swapper.py does) or read the clock itself.
"""

from __future__ import annotations

MAX_TENANTS = 4096  # stays remembered; the oldest beyond are forgotten (the operator's keep-alive still holds)


class Residency:
    def __init__(self, base: float, bound: float) -> None:
        """`base`: WORKER_KEEP_ALIVE, seconds every use keeps the model (0: never unloaded); `bound`:
        WORKER_KEEP_ALIVE_MAX, the longest stay a request may ask for (negative: no bound, and a request's
        negative `keep_alive` keeps the model for good)."""
        self._base = base if base > 0 else None
        self._bound = bound
        self._stays: dict[str, tuple[float | None, float]] = {}  # tenant -> (its stay, None: for good; last use)

    def granted(self, keep_alive: float) -> float | None:
        """The stay a request's `keep_alive` gets: within the operator's bound; None: for good."""
        if self._bound < 0:
            return None if keep_alive < 0 else keep_alive
        return self._bound if keep_alive < 0 else min(keep_alive, self._bound)

    def ask(self, tenant: str, keep_alive: float, now: float) -> None:
        """`tenant`'s request asked for `keep_alive` seconds: its own stay from now on."""
        self._stays.pop(tenant, None)
        self._stays[tenant] = (self.granted(keep_alive), now)
        while len(self._stays) > MAX_TENANTS:
            del self._stays[next(iter(self._stays))]

    def used(self, tenant: str, now: float) -> None:
        """A request of `tenant` ended: its stay counts from now."""
        if (held := self._stays.get(tenant)) is not None:
            self._stays[tenant] = (held[0], now)

    def idle_allowed(self, used_at: float, now: float) -> float | None:
        """Seconds since `used_at` (the model's last use) it may stay idle before it is unloaded; None:
        never. Stays run out are forgotten."""
        if self._base is None:
            return None
        until = used_at + self._base
        for tenant, (stay, last) in list(self._stays.items()):
            if stay is None:
                return None
            if last + stay <= now:
                del self._stays[tenant]
                continue
            until = max(until, last + stay)
        return until - used_at
