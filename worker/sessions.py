"""Sessions and KV accounting: who holds which llama.cpp sequence and cells, and how much KV is promised.

Owns: the table of sessions (named ones kept between turns, one-shot ones freed at stream end), the
pool of sequence ids, the prefix cache (free sequences whose cells still hold what their last request
left, and the choice of the longest cached prefix of a new prompt), the count of KV cells with shared
cells counted once, KV reservations against the total budget, idle-session expiry and eviction, and
tombstones of expired sessions (so a late turn gets 404 instead of silently starting afresh).
Must not: call llama.cpp. Freeing, cutting, copying or sharing cells is the engine's job: every method
that gives a sequence up returns its id, and the caller queues the free on the engine *before* any
request that could reuse that id (the engine's inbox is FIFO); `adopt` and `cut` record what the
engine is about to do to a sequence's cells.

Cells. A sequence holds positions 0..n-1, one KV cell each, listed in `Session.tokens`. In a unified
KV cache, llama_memory_seq_cp shares cells: two sequences can hold the very same cells for a common
prefix, and llama.cpp keeps a cell until no sequence id is left on it. `Run`s mirror that: the cells a
sequence wrote at consecutive positions are one run, a sequence that shares a prefix lists the same
run objects, and a run's cells in use are the longest extent any holder has in it. In a split cache
(one buffer per sequence) nothing is shared; each sequence's runs are its own.

Thread safety: admission runs on the event loop, release and adopt on the engine thread; one lock
guards all. The engine appends decoded tokens to a busy session's `tokens` without the lock: readers
see one list length or the next.
"""

from __future__ import annotations

import collections
import heapq
import itertools
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field

from protocol import reasons
from protocol.health import SessionInfo
from worker.errors import WorkerError
from worker.model import Message


@dataclass(frozen=True)
class KvLimits:
    capacity_tokens: int  # KV cells of the whole llama.cpp context
    session_max_tokens: int  # cells one session may hold: prompt + generated
    max_sessions: int  # llama.cpp sequences, busy or idle
    bytes_per_token: int

    def __post_init__(self) -> None:
        if not 1 <= self.session_max_tokens <= self.capacity_tokens:
            raise ValueError("session_max_tokens must be between 1 and the context size")


class Run:
    """KV cells one sequence filled at consecutive positions from `start` on (identity matters: the
    sequences that list the same run hold the same cells)."""

    __slots__ = ("start",)

    def __init__(self, start: int) -> None:
        self.start = start

    def __repr__(self) -> str:
        return f"Run({self.start})@{id(self) & 0xffff:04x}"


@dataclass(eq=False)
class Session:
    seq_id: int
    session_id: str | None  # None: one-shot, freed when its stream ends
    last_used: float
    tokens: list[int] = field(default_factory=list)  # what the sequence's KV cells hold, in order
    messages: list[Message] = field(default_factory=list)  # chat history, for templated turns
    reserved_tokens: int = 0  # busy: positions the request may reach (prompt + output); idle: held
    busy: bool = False
    runs: list[Run] = field(default_factory=lambda: [Run(0)])  # the cells behind `tokens`, by position


@dataclass(frozen=True)
class Admission:
    session: Session
    freed_seq_ids: tuple[int, ...]  # evicted idle sessions and cache: free these on the engine first
    cached_tokens: int = 0  # leading prompt tokens the session's own cells already hold (kept, not prefilled)
    restore: tuple[list[int], list[Run]] | None = None  # a kept session's cells before this admission


@dataclass(frozen=True)
class KvCells:
    """KV cells in use, each counted once however many sequences hold it."""

    live: int  # held by sessions (streaming or kept)
    cached: int  # held only by free sequences: the prefix cache, given up when room is needed
    shared: int  # held by more than one sequence (shared prefixes, unified KV only)
    growth: int  # cells the running requests may still add, up to their reservations

    @property
    def promised(self) -> int:
        return self.live + self.growth


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token lists. Slices are compared in C, halving the
    unsure range each time: O(n) element comparisons, no Python loop over tokens."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo] and a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


def _cut_runs(runs: list[Run], keep: int) -> list[Run]:
    """The runs behind the first `keep` positions, then a new run where the sequence writes next (a
    fresh one: another sequence may hold the cells past `keep` of the last kept run)."""
    return [run for run in runs if run.start < keep] + [Run(keep)]


def _spans(session: Session) -> Iterator[tuple[Run, int]]:
    """(run, cells of it this session holds) for each run it holds cells of."""
    n, runs = len(session.tokens), session.runs
    for i, run in enumerate(runs):
        end = min(n, runs[i + 1].start) if i + 1 < len(runs) else n
        if end > run.start:
            yield run, end - run.start


def count_cells(live: Iterable[Session], free: Iterable[Session]) -> KvCells:
    """Cells of `live` sessions and of `free` sequences' leftovers, each cell once: per run, the
    longest extent any holder has in it (what llama.cpp keeps: a cell while any sequence is on it)."""
    top: dict[Run, list[int]] = {}  # run -> [longest live extent, longest extent, second longest]
    growth = 0
    for is_live, group in ((True, live), (False, free)):
        for session in group:
            if is_live and session.busy:
                growth += max(0, session.reserved_tokens - len(session.tokens))
            for run, n in _spans(session):
                t = top.setdefault(run, [0, 0, 0])
                if is_live and n > t[0]:
                    t[0] = n
                if n > t[1]:
                    t[1], t[2] = n, t[1]
                elif n > t[2]:
                    t[2] = n
    live_cells = sum(t[0] for t in top.values())
    return KvCells(live=live_cells, cached=sum(t[1] for t in top.values()) - live_cells,
                   shared=sum(t[2] for t in top.values()), growth=growth)


class SessionTable:
    def __init__(self, limits: KvLimits, clock: Callable[[], float], *, ttl: float,
                 tombstones: int = 4096, kv_unified: bool = False) -> None:
        self.limits = limits
        self.ttl = ttl
        # Unified KV (set by the engine that owns the cells, `Engine.bind`): free sequences' leftover
        # cells sit in the one pool every sequence fills, so they count against capacity and are given
        # up for room; with a split cache they sit in their own sequence's buffer and cost nobody room.
        self.kv_unified = kv_unified
        self._clock = clock
        self._lock = threading.Lock()
        # Split KV: lowest free id first. llama.cpp decodes a batch whose sequence ids are ascending and
        # contiguous in one pass; scattered ids make it split the batch (docs/benchmarks.md, worker
        # throughput: 0.82 -> 0.96 of the in-process ceiling once ids were handed out this way).
        self._free_seq_ids = list(range(limits.max_sessions))
        # Free sequences whose cells still hold their last request's tokens (the prefix cache), least
        # recently freed first. A new request reuses what its own sequence holds (`admit`) or what any
        # other sequence holds (`adopt`).
        self._leftover: collections.OrderedDict[int, Session] = collections.OrderedDict()
        self._named: dict[str, Session] = {}
        self._live: set[Session] = set()
        self._idle_lru: collections.OrderedDict[int, Session] = collections.OrderedDict()  # by seq_id
        self._expired: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._tombstone_limit = tombstones
        self.evicted_total = 0
        self.expired_total = 0

    # -- admission (event loop) --------------------------------------------------------------------

    def lookup(self, session_id: str) -> Session | None:
        """The idle or busy session of that id; raises 404 if it expired or was evicted."""
        with self._lock:
            if session_id in self._expired:
                raise WorkerError(404, reasons.SESSION_EXPIRED, f"session {session_id!r} expired")
            return self._named.get(session_id)

    def admit(self, session_id: str | None, need_tokens: int, prompt: Sequence[int] | None = None) -> Admission:
        """Reserves a sequence and KV for one request that may reach `need_tokens` positions, or raises
        409/503 having changed nothing.

        The session's cells are cut to the longest prefix of `prompt` they hold (at most all but its
        last token, which must be decoded for logits): a kept session's earlier turns, or what the free
        sequence it takes was left holding. `prompt` None keeps the cells as they are. Room is made by
        giving up cached cells (unified KV), then idle sessions, least recently used first, but only
        if that makes enough room.
        """
        if need_tokens > self.limits.session_max_tokens:
            raise ValueError("need_tokens is above the session limit; validate before admitting")
        wanted = list(prompt) if prompt is not None else None
        with self._lock:
            known = self._named.get(session_id) if session_id else None
            if known is not None and known.busy:
                raise WorkerError(409, reasons.SESSION_BUSY, f"session {session_id!r} is generating")
            gone: list[Session] = []  # idle sessions and cached sequences to give up, in this order
            if known is None and not self._free_seq_ids:
                donor = next((s for s in self._idle_lru.values()), None)
                if donor is None:
                    raise WorkerError(503, reasons.SESSIONS_FULL, "every sequence slot is in use")
                gone.append(donor)
            plan = self._plan(known, session_id, need_tokens, wanted, gone)
            spare = [s for s in self._evictable(keep=known, taken=plan.seq_id) if s not in gone]
            if self._excess(plan, known, gone + spare) > 0:
                raise WorkerError(503, reasons.KV_FULL, "not enough KV cache left for this request")
            while self._excess(plan, known, gone) > 0:
                gone.append(spare.pop(0))
            freed = [self._give_up(s) for s in gone]
            return self._commit(plan, known, tuple(freed))

    def _plan(self, known: Session | None, session_id: str | None, need: int, prompt: list[int] | None,
              gone: list[Session]) -> Session:
        """The admitted session as it will be, not yet in the table: its sequence, the prefix of its
        cells it keeps, its reservation."""
        if known is not None:
            seq_id, tokens, runs, messages = known.seq_id, known.tokens, known.runs, known.messages
        else:
            seq_id = gone[0].seq_id if gone else self._pick_free()
            cells = self._leftover.get(seq_id)
            tokens, runs, messages = (cells.tokens, cells.runs, []) if cells else ([], [Run(0)], [])
        keep = len(tokens) if prompt is None else max(0, min(common_prefix(tokens, prompt), len(prompt) - 1))
        return Session(seq_id=seq_id, session_id=session_id, last_used=self._clock(), tokens=tokens[:keep],
                       messages=messages, reserved_tokens=need, busy=True, runs=_cut_runs(runs, keep))

    def _pick_free(self) -> int:
        if not self.kv_unified:
            return self._free_seq_ids[0]  # lowest: contiguous ids (see __init__)
        # Unified KV: ids do not matter to llama.cpp (one pass whatever they are), cached cells do: take a
        # sequence that holds nothing, else the one freed longest ago.
        empty = [seq_id for seq_id in self._free_seq_ids if seq_id not in self._leftover]
        return min(empty) if empty else next(iter(self._leftover))

    def _evictable(self, *, keep: Session | None, taken: int) -> list[Session]:
        """What may be given up for room, first to last: cached cells (only in a unified pool: in a
        split cache they take room from nobody), then idle named sessions, least recently used first."""
        cached = [s for seq_id, s in self._leftover.items() if seq_id != taken] if self.kv_unified else []
        return cached + [s for s in self._idle_lru.values() if s is not keep]

    def _excess(self, plan: Session, replaced: Session | None, gone: list[Session]) -> int:
        """Cells over capacity if `plan` were admitted (in place of `replaced`) and `gone` given up."""
        live = itertools.chain((s for s in self._live if s is not replaced and s not in gone), (plan,))
        free = (s for seq_id, s in self._leftover.items() if seq_id != plan.seq_id and s not in gone)
        cells = count_cells(live, free)
        held = cells.promised + (cells.cached if self.kv_unified else 0)
        return held - self.limits.capacity_tokens

    def _give_up(self, session: Session) -> int:
        if self._leftover.get(session.seq_id) is session:
            del self._leftover[session.seq_id]  # its id stays free; the engine clears the cells
        else:
            del self._idle_lru[session.seq_id]
            self._drop(session)
            self.evicted_total += 1
        return session.seq_id

    def _commit(self, plan: Session, known: Session | None, freed: tuple[int, ...]) -> Admission:
        if known is not None:
            restore = (known.tokens, known.runs)
            self._idle_lru.pop(known.seq_id, None)
            known.tokens, known.runs = plan.tokens, plan.runs
            known.reserved_tokens, known.busy, known.last_used = plan.reserved_tokens, True, plan.last_used
            return Admission(known, freed, len(plan.tokens), restore)
        self._free_seq_ids.remove(plan.seq_id)
        heapq.heapify(self._free_seq_ids)
        self._leftover.pop(plan.seq_id, None)
        self._live.add(plan)
        if plan.session_id:
            self._named[plan.session_id] = plan
        return Admission(plan, freed, len(plan.tokens))

    def abandon(self, admission: Admission) -> int | None:
        """The admitted request will not run after all (nothing reached the engine): a kept session is
        given back the cells it had and stays kept; a new sequence is given up. Returns the seq id to
        free on the engine, or None."""
        session = admission.session
        if admission.restore is not None:
            with self._lock:
                session.tokens, session.runs = admission.restore
        return self.release(session, keep_kv=admission.restore is not None)

    # -- the engine beginning a request (engine thread) -----------------------------------------------

    def adopt(self, session: Session, prompt: Sequence[int], *, min_gain: int = 1) -> int | None:
        """The sequence whose cells hold the longest prefix of `prompt`, if that beats what `session`
        kept by at least `min_gain` tokens (and leaves the prompt's last token to decode). `session`
        then holds that prefix; the caller must make its cells so before the next decode
        (llama_memory_seq_cp: shared cells in a unified cache, a copy in a split one). Returns the
        source's seq id, or None to keep what the session has.

        Any sequence's `tokens` is a prefix of what its cells hold when the engine looks: running and
        kept ones hold exactly their tokens, an admitted one not begun yet holds more until cut, and a
        free one holds its leftover until it is taken or its free reaches the engine."""
        limit = len(prompt) - 1
        with self._lock:
            best, best_n = None, len(session.tokens) + max(1, min_gain) - 1
            for other in itertools.chain(self._live, self._leftover.values()):
                if other is session or len(other.tokens) <= best_n:
                    continue
                n = min(common_prefix(other.tokens, prompt), limit)
                if n > best_n:
                    best, best_n = other, n
            if best is None:
                return None
            session.tokens = best.tokens[:best_n]
            # Unified: the very cells of `best`. Split: cells of the session's own buffer, a copy.
            session.runs = _cut_runs(best.runs, best_n) if self.kv_unified else [Run(0)]
            return best.seq_id

    def cut(self, session: Session, keep: int) -> None:
        """The engine dropped the session's cells from position `keep` on."""
        with self._lock:
            session.tokens = session.tokens[:keep]
            session.runs = _cut_runs(session.runs, keep)

    # -- release (engine thread, or event loop when a request never started) -------------------------

    def release(self, session: Session, *, keep_kv: bool, retain_cells: bool = False) -> int | None:
        """The request on `session` ended. Returns the seq id to free on the engine, or None if kept.

        `retain_cells`: the sequence is given up but its cells keep their tokens as a prefix cache for
        later requests (None is returned: nothing to free).
        """
        with self._lock:
            session.busy = False
            session.last_used = self._clock()
            named = session.session_id is not None and self._named.get(session.session_id) is session
            if keep_kv and named and session in self._live:
                session.reserved_tokens = len(session.tokens)
                self._idle_lru[session.seq_id] = session
                return None
            if session in self._live:
                self._drop(session)
                if retain_cells and session.tokens:
                    self._leftover[session.seq_id] = session
                    return None
                return session.seq_id
            return None

    def _drop(self, session: Session, *, tombstone: bool = True) -> None:
        self._live.discard(session)
        session.reserved_tokens = 0
        heapq.heappush(self._free_seq_ids, session.seq_id)
        if session.session_id is not None and self._named.get(session.session_id) is session:
            del self._named[session.session_id]
        if session.session_id is not None and tombstone:
            self._expired[session.session_id] = None
            while len(self._expired) > self._tombstone_limit:
                self._expired.popitem(last=False)

    # -- expiry and deletion -----------------------------------------------------------------------

    def expire_idle(self) -> list[int]:
        """Drops idle sessions unused for longer than the TTL; returns their seq ids to free."""
        cutoff = self._clock() - self.ttl
        with self._lock:
            stale = [s for s in self._idle_lru.values() if s.last_used <= cutoff]
            for session in stale:
                del self._idle_lru[session.seq_id]
                self._drop(session)
            self.expired_total += len(stale)
            return [s.seq_id for s in stale]

    def delete(self, session_id: str) -> Session:
        """Forgets a named session (its id may start a new one at once).

        An idle session is dropped here and its seq id must be freed by the caller; a busy one is
        returned for cancelling, and its release will free it instead of keeping it.
        """
        with self._lock:
            session = self._named.pop(session_id, None)
            if session is None:
                raise WorkerError(404, reasons.UNKNOWN_SESSION, f"no session {session_id!r}")
            if not session.busy:
                self._idle_lru.pop(session.seq_id, None)
                self._drop(session, tombstone=False)
            return session

    # -- reading -----------------------------------------------------------------------------------

    def cells(self) -> KvCells:
        with self._lock:
            return count_cells(self._live, self._leftover.values())

    def stats(self) -> tuple[int, int, int]:
        """(sessions holding a sequence, KV cells they hold, cells promised: held + what running requests
        may still add). Shared cells count once; the prefix cache counts as free (it is given up for room)."""
        with self._lock:
            cells = count_cells(self._live, self._leftover.values())
            return len(self._live), cells.live, cells.promised

    def describe(self) -> list[SessionInfo]:
        now = self._clock()
        bpt = self.limits.bytes_per_token
        with self._lock:
            return [
                SessionInfo(session_id=sid, tokens=len(s.tokens), kv_bytes=len(s.tokens) * bpt,
                            idle_seconds=0.0 if s.busy else max(0.0, now - s.last_used), busy=s.busy)
                for sid, s in self._named.items()
            ]
