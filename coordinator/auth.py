"""Client API keys: who may use the generation surfaces, and which tenant each key belongs to.

Owns: the configured keys (as SHA-256 digests, never the keys themselves after start-up), reading a
presented key from `Authorization: Bearer <key>` or `X-API-Key`, the constant-time check, the short
key id (a hash prefix) that metrics count requests by, and each key's tenant.
Must not: log or expose a key.

A tenant owns what the pool keeps between requests: session ids, conversation affinity, cached
answers, and on the workers the prompt cache and prefix copies (docs/reliability.md, "Tenancy").
Each key is its own tenant (`k:` and a hash of the key), unless its entry names one: the entries
`KEY acme` and `OTHER acme` are two keys of tenant `t:acme`, which share those caches on purpose
(one organisation's keys sharing a system prompt). Without keys every client is tenant "".
An entry may also set the key's limits (`KEY acme 1 rpm=60 tpm=20000 streams=4 budget=1000000/day`):
admission/limits.py holds each key to them. A tenant is also the unit of fair shares under overload (admission/fairness.py): `KEY acme 3` gives
tenant `t:acme` three times the share of a tenant of weight 1, the default.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from protocol.inference import PRIORITY_CLASSES

TENANT_NAME = re.compile(r"[A-Za-z0-9._-]{1,48}")

PERIODS = ("hour", "day", "week", "month")
LIMITS = ("streams", "rpm", "tpm", "budget")
CLASS_OPTIONS = ("priority", "max_priority")
MAX_LIMIT = 10**12


@dataclass(frozen=True, slots=True)
class KeyLimits:
    """A key's limits (admission/limits.py counts them; None: no limit of that kind) and priority
    classes (admission/priority.py), from its entry's `name=value` options."""

    streams: int | None = None  # requests of the key running at once
    rpm: int | None = None  # requests a minute
    tpm: int | None = None  # tokens (prompt + generated) a minute
    budget: int | None = None  # tokens a `period`, counted from the period's start (UTC)
    period: str = "day"
    priority: str = PRIORITY_CLASSES[-1]  # the class of a request that names none
    max_priority: str = PRIORITY_CLASSES[-1]  # the highest class it may name

    @property
    def any(self) -> bool:
        return any(v is not None for v in (self.streams, self.rpm, self.tpm, self.budget))

    @classmethod
    def parse(cls, options: Iterable[str], where: str) -> KeyLimits:
        """`options`: `streams=N`, `rpm=N`, `tpm=N`, `budget=N` or `budget=N/PERIOD` (hour, day,
        week, month; day by default), `priority=CLASS`, `max_priority=CLASS`. A malformed one raises
        `ValueError` naming `where`."""
        values: dict[str, int | str] = {}
        for option in options:
            name, sep, value = option.partition("=")
            if not sep or name not in LIMITS + CLASS_OPTIONS or name in values:
                raise ValueError(f"api_keys, {where}: {option!r} is not a limit (each once: "
                                 f"{', '.join(n + '=N' for n in LIMITS)}, budget=N/{'|'.join(PERIODS)}, "
                                 f"priority=CLASS, max_priority=CLASS)")
            if name in CLASS_OPTIONS:
                values[name] = _class(name, value, where)
                continue
            if name == "budget" and "/" in value:
                value, values["period"] = value.split("/", 1)
                if values["period"] not in PERIODS:
                    raise ValueError(f"api_keys, {where}: budget period {values['period']!r} is not one of "
                                     f"{', '.join(PERIODS)}")
            if not value.isdigit() or not 0 < int(value) <= MAX_LIMIT:
                raise ValueError(f"api_keys, {where}: {name}={value!r} is not a whole number from 1 to {MAX_LIMIT}")
            values[name] = int(value)
        limits = cls(**values)  # type: ignore[arg-type]
        if PRIORITY_CLASSES.index(limits.priority) > PRIORITY_CLASSES.index(limits.max_priority):
            raise ValueError(f"api_keys, {where}: priority={limits.priority} is above max_priority={limits.max_priority}")
        return limits


def _class(name: str, value: str, where: str) -> str:
    if value not in PRIORITY_CLASSES:
        raise ValueError(f"api_keys, {where}: {name}={value!r} is not a priority class "
                         f"({', '.join(reversed(PRIORITY_CLASSES))})")
    return value


def key_id(key: str) -> str:
    """A short, stable, non-secret name for a key: metrics label requests with it."""
    return hashlib.sha256(key.encode()).hexdigest()[:8]


def own_tenant(key: str) -> str:
    """The tenant of a key whose entry names none: a longer hash than `key_id`, so two keys never meet."""
    return "k:" + hashlib.sha256(key.encode()).hexdigest()[:16]


@dataclass(frozen=True, slots=True)
class Client:
    key_id: str
    tenant: str
    limits: KeyLimits = KeyLimits()


class ApiKeys:
    def __init__(self, entries: Iterable[str | tuple[str, str]]) -> None:
        """`entries`: `KEY`, `KEY TENANT` or `KEY TENANT WEIGHT` each, then any limits as `name=value`
        (`KeyLimits.parse`), whitespace between; or `(where, entry)` pairs, `where` naming the entry's
        place (a file's line) in errors."""
        self._keys: list[tuple[bytes, Client]] = []
        self.weights: dict[str, float] = {}  # tenant -> its fair-share weight, where an entry gave one
        seen: set[str] = set()
        for number, item in enumerate(entries, start=1):
            where, entry = item if isinstance(item, tuple) else (f"entry {number}", item)
            words = entry.split()
            parts = [w for w in words if "=" not in w]
            if not parts or parts[0] in seen:
                continue
            key, tenant, weight = parts[0], *_tenant_and_weight(parts, where)
            limits = KeyLimits.parse((w for w in words if "=" in w), where)
            seen.add(key)
            tenant = tenant or own_tenant(key)
            if weight is not None and self.weights.setdefault(tenant, weight) != weight:
                raise ValueError(f"api_keys, {where}: tenant {tenant[2:]!r} was given weight "
                                 f"{self.weights[tenant]:g} by an earlier key, and {weight:g} here")
            self._keys.append((hashlib.sha256(key.encode()).digest(), Client(key_id(key), tenant, limits)))
        if not self._keys:
            raise ValueError("api_keys: no key given")

    @classmethod
    def from_setting(cls, value: str | None) -> ApiKeys | None:
        """`value`: a path to a file with one entry per line (# comments allowed), or entries separated
        by commas; None or empty: no keys, every client is let in."""
        if not value:
            return None
        path = Path(value)
        if "," not in value and path.is_file():
            lines = ((f"{path.name} line {number}", line.strip())
                     for number, line in enumerate(path.read_text().splitlines(), start=1))
            return cls((where, line) for where, line in lines if line and not line.startswith("#"))
        return cls(part.strip() for part in value.split(","))

    def __len__(self) -> int:
        return len(self._keys)

    def client(self, key_id: str) -> Client | None:
        """The client of the key whose id is `key_id` (a batch runs as the key that created it), or None
        when no configured key has it (any more)."""
        return next((client for _, client in self._keys if client.key_id == key_id), None)

    def identify(self, headers: Mapping[str, str]) -> Client | None:
        """The client whose key the request presents, or None. Compares against every key, in constant
        time each, so timing tells neither which key nor how much of one matched."""
        presented = headers.get("x-api-key") or ""
        authorization = headers.get("authorization") or ""
        if not presented and authorization[:7].lower() == "bearer ":
            presented = authorization[7:].strip()
        digest = hashlib.sha256(presented.encode()).digest()
        found = None
        for expected, client in self._keys:
            if hmac.compare_digest(digest, expected) and presented:
                found = client
        return found


def _tenant_and_weight(parts: list[str], where: str) -> tuple[str | None, float | None]:
    """An entry's tenant (`t:` and its name; None: the key's own) and weight (None: not given)."""
    if len(parts) > 3 or (len(parts) >= 2 and not TENANT_NAME.fullmatch(parts[1])):
        raise ValueError(f"api_keys, {where}: each entry is KEY, 'KEY TENANT' or 'KEY TENANT WEIGHT', a tenant "
                         "name being 1 to 48 of A-Z a-z 0-9 . _ -")
    tenant = f"t:{parts[1]}" if len(parts) >= 2 else None
    if len(parts) < 3:
        return tenant, None
    try:
        weight = float(parts[2])
    except ValueError:
        weight = float("nan")
    if not 0 < weight <= 1_000_000:  # also false for nan and inf
        raise ValueError(f"api_keys, {where}: the weight {parts[2]!r} is not a number above 0 (and at most 1e6)")
    return tenant, weight


# The key of the request's tenant in the ASGI scope's state, where the app's gate puts it, and of its client.
TENANT = "tenant"
CLIENT = "client"


def tenant_of(scope_state: Mapping[str, object]) -> str:
    """The tenant a let-in request belongs to ("" when the pool has no keys)."""
    tenant = scope_state.get(TENANT, "")
    return tenant if isinstance(tenant, str) else ""


def client_of(scope_state: Mapping[str, object]) -> Client | None:
    """The client whose key let the request in (None when the pool has no keys)."""
    client = scope_state.get(CLIENT)
    return client if isinstance(client, Client) else None
