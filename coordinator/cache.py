"""The response cache: a repeated request whose output is fully determined is answered from memory.

Owns: which requests may be cached (greedy, or sampled with a fixed seed; never with a session), the
key (surface, model, and every field of the internal request: prompt or messages, sampling,
max_tokens, stop), the recorded internal events of complete streams, an LRU bounded in entries and
bytes with a TTL per entry, and optional persistence in SQLite (standard library) so a restarted
coordinator keeps its cache.
Must not: shape any surface's output (a hit replays internal events through the surface's own
encoder, like a live stream: `Replay` reads them as a worker's stream, `done` marked `cached`) or hold
a worker resource (a hit is never admitted or reserved).

Persistence: every insertion and eviction is written through to the file at once (small writes on
the event loop; the file is bounded by the same entry and byte limits). A file that SQLite reports as
corrupt is moved aside (`<file>.corrupt-<unix time>`) and a fresh one started.

A cache that fails (a full disk, a file that became unwritable, any error while reading or writing
it) disables itself: the failure is logged once and counted (`on_failure`), `failure` says why (the
health endpoint shows it), every later lookup misses and every store is skipped. A request never
ends because its answer could not be cached.
"""

from __future__ import annotations

import hashlib
import json
import logging
import sqlite3
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from protocol.sse import SseEvent
from protocol.worker import EVENT_DONE, DoneEvent, GenerateRequest, Timings

log = logging.getLogger("coordinator.cache")
# The largest stream one entry may hold: every cacheable stream in flight records up to this much, so
# it bounds the relay's memory per stream, not only the cache's.
MAX_ENTRY_BYTES = 1 << 20


def cache_key(surface: str, model: str | None, request: GenerateRequest, identity: str = "") -> bytes | None:
    """The key of a request whose output is fully determined, else None (never cached). `identity`:
    what the model is beyond its public name (registry.identity_of), so a model swapped under the same
    name misses."""
    if request.session_id is not None:
        return None
    if request.temperature > 0 and request.seed is None:
        return None
    # Every field, defaults included: all decide the output, but how long the model stays loaded after.
    body = request.model_dump_json(exclude={"model", "keep_alive"})
    return hashlib.blake2b(f"{surface}\0{model or ''}\0{identity}\0{body}".encode(), digest_size=20).digest()


@dataclass(slots=True)
class Entry:
    events: tuple[SseEvent, ...]
    size: int
    stored_at: float
    identity: str = ""  # the model identities it was computed by (registry.identity_of)


def _size(events: tuple[SseEvent, ...]) -> int:
    return sum(len(e.event) + len(e.data) + 16 for e in events)


class ResponseCache:
    def __init__(self, *, entries: int, max_bytes: int, ttl: float, clock: Callable[[], float] = time.time,
                 path: Path | None = None, on_evict: Callable[[], None] | None = None,
                 on_failure: Callable[[], None] | None = None) -> None:
        self.max_entries = entries
        self.max_bytes = max_bytes
        self.ttl = ttl
        self._clock = clock
        self._entries: OrderedDict[bytes, Entry] = OrderedDict()
        self.bytes = 0
        self._on_evict = on_evict or (lambda: None)
        self._on_failure = on_failure or (lambda: None)
        self.failure: str | None = None  # why the cache disabled itself
        self._db: sqlite3.Connection | None = None
        if path is not None and self.enabled:
            self._db = self._open(path)
            self._load()

    @property
    def entry_limit(self) -> int:
        return min(self.max_bytes, MAX_ENTRY_BYTES)

    @property
    def enabled(self) -> bool:
        return self.max_entries > 0 and self.max_bytes > 0 and self.failure is None

    @property
    def state(self) -> Literal["off", "on", "disabled"]:
        """`off` (not configured), `on`, or `disabled` (it failed; `failure` says why)."""
        if self.failure is not None:
            return "disabled"
        return "on" if self.enabled else "off"

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: bytes) -> tuple[SseEvent, ...] | None:
        """The recorded events of `key`, or None (a miss; always None once the cache has failed)."""
        try:
            return self._get(key)
        except Exception as exc:  # noqa: BLE001 - logged and counted by _fail; a miss for the caller
            self._fail(exc)
            return None

    def put(self, key: bytes, events: tuple[SseEvent, ...], identity: str = "") -> None:
        """Stores a complete stream's events, computed by the model `identity`; skipped when too large
        or once the cache has failed."""
        if not self.enabled:
            return
        try:
            self._put(key, events, identity)
        except Exception as exc:  # noqa: BLE001 - logged and counted by _fail; the stream goes on
            self._fail(exc)

    def _fail(self, exc: Exception) -> None:
        """Disables the cache for good (until a restart): what it holds may no longer match its file."""
        if self.failure is not None:
            return
        self.failure = f"{type(exc).__name__}: {exc}"
        log.error(json.dumps({"event": "cache_disabled", "error": self.failure}), exc_info=exc)
        self._on_failure()
        self._entries.clear()
        self.bytes = 0
        db, self._db = self._db, None
        if db is not None:
            try:
                db.close()
            except sqlite3.Error:
                pass  # it is being given up anyway

    def _get(self, key: bytes) -> tuple[SseEvent, ...] | None:
        if self.failure is not None:
            return None
        entry = self._entries.get(key)
        if entry is None:
            return None
        if self._clock() - entry.stored_at > self.ttl:
            self._drop(key)
            return None
        self._entries.move_to_end(key)
        return entry.events

    def forget_identity(self, identity: str) -> None:
        """Drops the entries computed by a model identity no worker serves any more: they can no
        longer be hit (the key names the identity), so they only took room. O(entries), on the rare
        event of a model leaving the pool."""
        try:
            gone = [key for key, entry in self._entries.items() if identity in entry.identity.split("|")]
            for key in gone:
                self._drop(key)
        except Exception as exc:  # noqa: BLE001 - logged and counted by _fail
            self._fail(exc)

    def _put(self, key: bytes, events: tuple[SseEvent, ...], identity: str) -> None:
        size = _size(events)
        if size > self.entry_limit:
            return
        if key in self._entries:
            self._drop(key, evicted=False)
        entry = Entry(events, size, self._clock(), identity)
        self._entries[key] = entry
        self.bytes += size
        self._write(key, entry)
        while len(self._entries) > self.max_entries or self.bytes > self.max_bytes:
            self._drop(next(iter(self._entries)))

    def close(self) -> None:
        if self._db is not None:
            self._db.close()
            self._db = None

    def _drop(self, key: bytes, *, evicted: bool = True) -> None:
        entry = self._entries.pop(key)
        self.bytes -= entry.size
        if evicted:
            self._on_evict()
        if self._db is not None:
            self._db.execute("DELETE FROM entries WHERE key = ?", (key,))
            self._db.commit()

    # -- persistence -------------------------------------------------------------------------------

    @staticmethod
    def _open(path: Path) -> sqlite3.Connection:
        path.parent.mkdir(parents=True, exist_ok=True)
        for attempt in range(2):
            try:
                db = sqlite3.connect(path)
                if db.execute("PRAGMA quick_check").fetchone()[0] != "ok":
                    raise sqlite3.DatabaseError("quick_check failed")
                db.execute("CREATE TABLE IF NOT EXISTS entries (key BLOB PRIMARY KEY, stored_at REAL, events TEXT)")
                db.commit()
                return db
            except sqlite3.DatabaseError as exc:
                if attempt:
                    raise
                aside = path.with_name(f"{path.name}.corrupt-{int(time.time())}")
                log.warning(json.dumps({"event": "cache_file_corrupt", "path": str(path), "moved_to": str(aside),
                                        "error": str(exc)}))
                path.replace(aside)
        raise AssertionError("unreachable")

    def _load(self) -> None:
        assert self._db is not None
        rows = self._db.execute("SELECT key, stored_at, events FROM entries ORDER BY stored_at").fetchall()
        now = self._clock()
        for key, stored_at, raw in rows:
            try:
                stored = json.loads(raw)
                events = tuple(SseEvent(e, d) for e, d in stored["events"])
                identity = str(stored["identity"])
            except (ValueError, TypeError, KeyError):
                continue  # a row we cannot read (or of an older format) is dropped below with the expired ones
            if now - stored_at > self.ttl:
                continue
            entry = Entry(events, _size(events), stored_at, identity)
            self._entries[key] = entry
            self.bytes += entry.size
        keep = set(self._entries)
        self._db.executemany("DELETE FROM entries WHERE key = ?", [(k,) for k, _, _ in rows if k not in keep])
        self._db.commit()
        while len(self._entries) > self.max_entries or self.bytes > self.max_bytes:
            self._drop(next(iter(self._entries)), evicted=False)

    def _write(self, key: bytes, entry: Entry) -> None:
        if self._db is not None:
            raw = json.dumps({"identity": entry.identity, "events": [[e.event, e.data] for e in entry.events]},
                             separators=(",", ":"))
            self._db.execute("INSERT OR REPLACE INTO entries VALUES (?, ?, ?)", (key, entry.stored_at, raw))
            self._db.commit()


class Replay:
    """A recorded stream, read like a worker's (relay.stream.Upstream): its `done` marked `cached`,
    with the replaying request's id and no completion tokens computed."""

    def __init__(self, events: tuple[SseEvent, ...], request_id: str) -> None:
        replayed = tuple(_as_hit(e, request_id) if e.event == EVENT_DONE else e for e in events)
        self.first = replayed[0]
        self.events = self._rest(replayed[1:])

    @staticmethod
    async def _rest(events: tuple[SseEvent, ...]) -> AsyncIterator[SseEvent]:
        for event in events:
            yield event

    async def close(self) -> None:
        pass


def _as_hit(event: SseEvent, request_id: str) -> SseEvent:
    done = DoneEvent.model_validate_json(event.data)
    usage = done.usage.model_copy(update={"completion_tokens": 0, "cached_tokens": done.usage.prompt_tokens,
                                          "total_tokens": done.usage.prompt_tokens})
    timings = Timings(queue_ms=0.0, prefill_ms=0.0, ttft_ms=0.0, total_ms=0.0, tokens_per_second=0.0)
    choices = [end.model_copy(update={"completion_tokens": 0}) for end in done.choices] if done.choices else None
    hit = done.model_copy(update={"cached": True, "request_id": request_id, "usage": usage, "timings": timings,
                                  "worker_id": "cache", "choices": choices})
    return SseEvent(EVENT_DONE, hit.model_dump_json())
