"""Sessions and KV accounting: who holds which llama.cpp sequence and how much KV is promised.

Owns: the table of sessions (named ones kept between turns, one-shot ones freed at stream end), the
pool of sequence ids, KV reservations against the total budget, idle-session expiry and eviction,
and tombstones of expired sessions (so a late turn gets 404 instead of silently starting afresh).
A request with several choices (`n` > 1, always one-shot) is admitted as a group: n one-shot
sessions, each its own sequence and its own reservation, all or none.
Must not: call llama.cpp. Freeing a sequence's cells is the engine's job: every method that gives
a sequence up returns its id, and the caller queues the free on the engine *before* any request that
could reuse that id (the engine's inbox is FIFO).

Tenancy: every session belongs to the tenant (the coordinator's name for a client API key) that
opened it. Named sessions and their tombstones are keyed by (tenant, session id), so another
tenant's id names nothing here: same 404s, same fresh start, never a 409 that would betray it. The
prompt cache (a freed sequence's leftover cells) and the prefix copy between sequences serve only
the tenant whose prompt filled those cells: otherwise `cached_tokens`, and the time to first token,
would tell a tenant whether its guess of another tenant's prompt is right.

Kept leftovers (`cache_keep`, Anthropic's `cache_control`): a freed sequence's cells may be kept for a
while: a new request takes another free sequence first (an empty one, an unkept leftover, even one that
adds a run of sequence ids), and a kept one only when every free one is kept (the keep that ends soonest
first). A keep holds no capacity: the sequence stays free, and is only the last to be reused. At most
`kept_per_tenant` per tenant at once, so one tenant's keeps cannot claim every free sequence.

The prompt cache in host memory: a session that takes a freed sequence holding an interactive request's
cells carries what they held (`Session.displaced`), for the engine to save them (sessions/host_cache.py)
before it clears them. A batch request's leftover carries nothing (`_Leftover.batch`).

Parking (preemption): a one-shot batch request's session may be parked by the engine for an
interactive request. Its sequence goes back to the free ones and its reservation is returned, so the
interactive request is admitted in its place; the engine keeps its cells in host memory. It comes
back with `unpark` on any free sequence. Until then a batch admission leaves room for every parked
session (`admit(..., yields=True)`): a parked request resumes before a newer batch request starts.

Thread safety: admission runs on the event loop, release on the engine thread; one lock guards all.
"""

from __future__ import annotations

import collections
import dataclasses
import heapq
import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from protocol import reasons
from protocol.health import MAX_HELD_PREFIX_BLOCKS, SessionInfo
from worker.errors import WorkerError
from worker.sessions.messages import Message


def shared_prefix(a: list[int], b: list[int]) -> int:
    """Length of the common prefix of two token lists: slices compared in C, halving the range."""
    lo, hi = 0, min(len(a), len(b))
    if a[:hi] == b[:hi]:
        return hi
    while lo < hi:  # a[:lo] == b[:lo] and a[:hi] != b[:hi]
        mid = (lo + hi + 1) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


@dataclass(frozen=True)
class KvLimits:
    capacity_tokens: int  # KV cells of the whole llama.cpp context
    session_max_tokens: int  # cells one session may hold: prompt + generated
    max_sessions: int  # llama.cpp sequences, busy or idle
    bytes_per_token: int

    def __post_init__(self) -> None:
        if not 1 <= self.session_max_tokens <= self.capacity_tokens:
            raise ValueError("session_max_tokens must be between 1 and the context size")


@dataclass(eq=False)
class Session:
    seq_id: int
    session_id: str | None  # None: one-shot, freed when its stream ends
    last_used: float
    tenant: str = ""  # whose session it is; its id and its cells serve no other tenant
    tokens: list[int] = field(default_factory=list)  # what the sequence's KV cells hold, in order
    messages: list[Message] = field(default_factory=list)  # chat history, for templated turns
    reserved_tokens: int = 0
    busy: bool = False
    stream_ref: int | None = None  # the coordinator's reference of the stream running on it now
    # The mover (a coordinator's `mover` id) that exported it while the worker drains: one coordinator
    # moves it, not two; None: not handed over. The same mover may export it again (its put failed).
    handed_over: str | None = None
    # The coordinator's hashes of the text whose prompt its cells hold (GenerateRequest.prefix_blocks).
    prefix_blocks: tuple[str, ...] = ()
    keep: float = 0.0  # seconds its cells stay kept once it is freed (GenerateRequest.cache_keep); 0: none
    batch: bool = False  # a batch request's: its leftover cells are not saved to host memory when taken
    # An interactive request's leftover cells (tenant, tokens) that this session's sequence held when it
    # was taken: the engine may save them to host memory (worker/sessions/host_cache.py) before clearing.
    displaced: tuple[str, list[int]] | None = None


@dataclass(frozen=True)
class TableLoad:
    """One consistent reading of the table, for a heartbeat."""

    sessions: int  # holding a sequence, busy or idle
    used_tokens: int
    reserved_tokens: int
    idle_sessions: int
    idle_reserved_tokens: int
    stream_refs: tuple[int, ...]  # the coordinator's references of the streams running now
    held: tuple[tuple[str, str], ...] = ()  # (tenant, session id) of every named session
    prefixes: tuple[str, ...] = ()  # prefix blocks the cells hold, most recently used first, bounded
    running_by_tenant: dict[str, int] = field(default_factory=dict)  # sequences streaming now, per tenant
    parked: int = 0  # sessions parked (no sequence; `stream_refs` lists them after the running ones)


@dataclass(frozen=True)
class _Leftover:
    """What a freed sequence's cells still hold, and for whom."""

    tenant: str
    tokens: list[int]
    prefix_blocks: tuple[str, ...] = ()
    kept_until: float = 0.0  # clock time until which other requests take other free sequences first
    batch: bool = False  # a batch request's cells (not worth host memory)


@dataclass(frozen=True)
class Admission:
    session: Session
    freed_seq_ids: tuple[int, ...]  # evicted idle sessions: free these on the engine first
    extra: tuple[Session, ...] = ()  # with several choices: the sessions of choices 1 to n-1


class SessionTable:
    def __init__(self, limits: KvLimits, clock: Callable[[], float], *, ttl: float,
                 tombstones: int = 4096, kept_per_tenant: int | None = None) -> None:
        """`kept_per_tenant`: the leftovers one tenant may have kept at once (`cache_keep`; a quarter of the
        sequences, at least 1, unless given): past it, its keep that ends soonest ends now."""
        self.limits = limits
        self.ttl = ttl
        self.kept_per_tenant = kept_per_tenant if kept_per_tenant is not None else max(1, limits.max_sessions // 4)
        self._clock = clock
        self._lock = threading.Lock()
        # Lowest free id first: llama.cpp decodes a batch whose sequence ids are ascending and
        # contiguous in one pass; scattered ids make it split the batch (docs/benchmarks.md, worker
        # throughput: 0.82 -> 0.96 of the in-process ceiling once ids were handed out this way).
        self._free_seq_ids = list(range(limits.max_sessions))
        # Tokens still in a free sequence's cells (split KV only: those cells serve no other sequence),
        # so a new request of the same tenant whose prompt they already hold skips that prefill.
        self._leftover: dict[int, _Leftover] = {}
        self._named: dict[tuple[str, str], Session] = {}  # by (tenant, session id)
        self._live: set[Session] = set()
        self._parked: dict[Session, None] = {}  # parked one-shot sessions, the first parked first
        self._idle_lru: collections.OrderedDict[int, Session] = collections.OrderedDict()  # by seq_id
        self._reserved_tokens = 0
        self._expired: collections.OrderedDict[tuple[str, str], None] = collections.OrderedDict()
        self._tombstone_limit = tombstones
        self.evicted_total = 0
        self.expired_total = 0
        # Sessions whose stream was cancelled (its client left) and that the engine has not released
        # yet: their slot and KV come back within one engine step.
        self._ending: set[Session] = set()
        self.on_release: Callable[[], None] = lambda: None  # after any release (any thread)
        # After a release that freed a sequence of a full table (any thread): with several coordinators,
        # the heartbeat tells them all at once (worker/heartbeat.py `nudge(room=True)`).
        self.on_room: Callable[[], None] = lambda: None
        self._room = False  # a release freed a sequence of a full table: `_released` calls on_room
        # A new named session (event loop): the heartbeat tells every coordinator at once, so that a
        # next turn sent to another coordinator finds it (worker/heartbeat.py `nudge`).
        self.on_named: Callable[[], None] = lambda: None

    # -- admission (event loop) --------------------------------------------------------------------

    def lookup(self, session_id: str, *, tenant: str = "", continuation: bool = True) -> Session | None:
        """`tenant`'s idle or busy session of that id. An id that expired or was evicted raises 404 when
        the caller claims a continuation; otherwise the id is free again and starts a new conversation."""
        key = (tenant, session_id)
        with self._lock:
            if key in self._expired:
                if continuation:
                    raise WorkerError(reasons.SESSION_EXPIRED, f"session {session_id!r} expired")
                del self._expired[key]
            return self._named.get(key)

    def admit(self, session_id: str | None, need_tokens: int, prompt: list[int] | tuple[int, ...] = (), *,
              tenant: str = "", stream_ref: int | None = None, choices: int = 1,
              prefix_blocks: tuple[str, ...] = (), yields: bool = False, keep: float = 0.0) -> Admission:
        """Reserves a sequence and `need_tokens` of KV for one request of `tenant`, or raises 409/503.

        `stream_ref`: the coordinator's reference of the request (`X-Stream-Ref`); heartbeats list it
        while the stream holds its session, so the coordinator knows which of its streams they count.

        A new sequence is the free one that already holds most of `prompt` for this tenant (see
        `_take_seq`); its `tokens` then say what its cells hold, and the engine keeps their common
        prefix. Taken from another tenant's leftover, its `tokens` are empty: the engine clears it all.

        `choices` > 1 (one-shot only): `choices` sequences and `choices` x `need_tokens` of KV, or
        nothing. Each choice holds its own copy of the prompt (with a split cache llama.cpp copies the
        cells into each sequence's stream), so each reserves what a lone request would; the extra
        sessions start empty (`Admission.extra`): the engine fills them with a copy of choice 0's.

        `prefix_blocks`: the coordinator's hashes of the request's text; every sequence of the request
        keeps them while its cells hold the prompt (`load().prefixes`).

        `yields` (a batch request): it is admitted only with room left for every parked session too.

        `keep` (a one-shot request's `cache_keep`): once it ends, its cells stay as a kept leftover that
        long, which other requests take only when every other free sequence is kept too (`_take_seq`).
        """
        if need_tokens > self.limits.session_max_tokens:
            raise ValueError("need_tokens is above the session limit; validate before admitting")
        if choices > 1 and session_id:
            raise ValueError("several choices are one-shot: no session_id")
        with self._lock:
            session = self._named.get((tenant, session_id)) if session_id else None
            if session is not None and session.busy:
                raise WorkerError(reasons.SESSION_BUSY, f"session {session_id!r} is generating")
            freed: list[int] = []
            owed = list(self._parked) if yields else []
            self._make_room(session, need_tokens * choices + sum(p.reserved_tokens for p in owed),
                            (0 if session else choices) + len(owed), freed)
            extra: list[Session] = []
            if session is None:
                session = self._new_session(session_id, prompt, tenant)  # first: choice 0 may find its prompt
                for _ in range(choices - 1):
                    seq_id = self._take_seq((), tenant, beside=session.seq_id)
                    extra.append(self._open(seq_id, tenant, need_tokens, stream_ref))
                    extra[-1].prefix_blocks = prefix_blocks
            else:
                self._idle_lru.pop(session.seq_id, None)
            session.prefix_blocks = prefix_blocks
            for each in (session, *extra):
                each.batch = yields
            session.keep = keep if session.session_id is None else 0.0  # a named session's cells stay anyway
            self._reserved_tokens += need_tokens - session.reserved_tokens
            session.reserved_tokens = need_tokens
            session.busy = True
            session.stream_ref = stream_ref
            return Admission(session, tuple(freed), tuple(extra))

    def _make_room(self, session: Session | None, tokens: int, sequences: int, freed: list[int]) -> None:
        """Evicts idle named sessions (never `session`, whose reservation is counted as free) until
        `tokens` of KV and `sequences` free sequences are left, or raises 503. Under the lock."""
        held = session.reserved_tokens if session else 0
        while self._reserved_tokens - held + tokens > self.limits.capacity_tokens:
            if not self._evict_one(keep=session, into=freed):
                raise WorkerError(reasons.KV_FULL, "not enough KV cache left for this request")
        while len(self._free_seq_ids) < sequences:
            if not self._evict_one(keep=None, into=freed):
                raise WorkerError(reasons.SESSIONS_FULL, "every sequence slot is in use")

    def _new_session(self, session_id: str | None, prompt: list[int] | tuple[int, ...], tenant: str) -> Session:
        """A session on the free sequence that fits `prompt` best (`_take_seq`), knowing what its cells
        hold when they are this tenant's; named, when it has an id. Under the lock."""
        seq_id = self._take_seq(prompt, tenant)
        left = self._leftover.pop(seq_id, None)
        session = Session(seq_id=seq_id, session_id=session_id, last_used=self._clock(), tenant=tenant,
                          tokens=left.tokens if left is not None and left.tenant == tenant else [],
                          displaced=_displaced(left))
        self._live.add(session)
        if session_id:
            self._named[(tenant, session_id)] = session
            self.on_named()
        return session

    def _open(self, seq_id: int, tenant: str, need_tokens: int, stream_ref: int | None) -> Session:
        """A busy one-shot session of a further choice on `seq_id`: empty whatever its cells held (the
        engine replaces them with a copy of choice 0's), holding its reservation. Under the lock."""
        session = Session(seq_id=seq_id, session_id=None, last_used=self._clock(), tenant=tenant,
                          reserved_tokens=need_tokens, busy=True, stream_ref=stream_ref,
                          displaced=_displaced(self._leftover.pop(seq_id, None)))
        self._live.add(session)
        self._reserved_tokens += need_tokens
        return session

    def _take_seq(self, prompt: list[int] | tuple[int, ...], tenant: str, beside: int | None = None) -> int:
        """A free sequence id that keeps the running ids in as few runs of consecutive ids as it can,
        and among those: the one whose leftover cells (of this tenant) share the longest prefix with the
        prompt, if that is at least half the prompt (or 256 of its tokens); else the lowest empty one,
        so no cells another prompt may match are overwritten; else the one freed longest ago, of any
        tenant (`admit` then reports it empty). Half, not all: a chat client's next turn resends the
        whole conversation, and the previous turn's cells hold all of it but the new message.

        Why runs: llama.cpp's split KV cache puts only consecutive sequence ids in one forward pass
        (`split_equal` with `sequential`), so running sequences 0, 3, 4 and 9 cost three passes over
        the weights a step where 3 to 6 cost one. Taking leftovers wherever they lay scattered the
        running ids once every sequence had been used, and 16 streams decoded 20% slower a step
        (docs/benchmarks.md, "Scattered sequence ids"). A free id next to a running one adds no run
        (or joins two); any other id adds one, and is taken only when none is next to one (an idle
        worker's first request may take any). `beside`: a sequence to count as running (a request's
        first choice, while its further ones are placed)."""
        fitting = self._fewest_runs(beside)
        best = self._best_leftover(fitting, prompt, tenant)
        if best < 0:
            # No match: an empty sequence (the lowest) rather than one whose cells a later prompt may
            # still want; when every fitting one holds some, the one freed longest ago that is not kept
            # (`cache_keep`); when every fitting one is kept, one that is not, fitting or not; else the
            # keep that ends soonest.
            empty = [i for i in fitting if i not in self._leftover]
            best = min(empty) if empty else self._oldest_unkept(fitting)
        self._free_seq_ids.remove(best)
        heapq.heapify(self._free_seq_ids)
        return best

    def _oldest_unkept(self, fitting: set[int]) -> int:
        now, leftover = self._clock(), self._leftover
        unkept = next((i for i, left in leftover.items() if i in fitting and left.kept_until <= now), None)
        if unkept is None:
            unkept = next((i for i in self._free_seq_ids if i not in leftover or leftover[i].kept_until <= now), None)
        if unkept is None:
            unkept = min(fitting, key=lambda i: leftover[i].kept_until)
        return unkept

    def _fewest_runs(self, beside: int | None) -> set[int]:
        """The free sequence ids that add the fewest runs of consecutive running ids (`_take_seq`)."""
        running = {s.seq_id for s in self._live if s.busy} | ({beside} if beside is not None else set())

        def runs_added(seq_id: int) -> int:
            return 1 - (seq_id - 1 in running) - (seq_id + 1 in running)

        fewest = min(runs_added(i) for i in self._free_seq_ids)
        return {i for i in self._free_seq_ids if runs_added(i) == fewest}

    def _best_leftover(self, fitting: set[int], prompt: list[int] | tuple[int, ...], tenant: str) -> int:
        """Of `fitting`, the sequence whose leftover cells of `tenant` share the longest prefix with
        `prompt`, at least half of it (or 256 tokens); -1 when none does."""
        best, best_len = -1, max(1, min(256, (len(prompt) + 1) // 2))
        wanted = list(prompt)
        for seq_id, left in self._leftover.items():
            if seq_id not in fitting or left.tenant != tenant:
                continue
            n = shared_prefix(left.tokens, wanted)
            if n >= best_len:
                best, best_len = seq_id, n
        return best

    def prefix_source(self, prompt: list[int], *, tenant: str, at_least: int,
                      skip: set[int]) -> tuple[int, int] | None:
        """The sequence (not in `skip`) whose cells hold the longest prefix of `tenant`'s `prompt`, and
        its length, if that is at least `at_least` tokens: a running or kept session of that tenant, or
        a freed sequence's leftover of that tenant. Engine thread only: the cells hold exactly what the
        table says there."""
        if at_least > len(prompt):
            return None
        best: tuple[int, int] | None = None
        with self._lock:
            held = [(s.seq_id, s.tokens) for s in self._live if s.tenant == tenant]
            held.extend((seq_id, left.tokens) for seq_id, left in self._leftover.items() if left.tenant == tenant)
            for seq_id, cells in held:
                if seq_id in skip or len(cells) < at_least or cells[0] != prompt[0]:
                    continue
                n = shared_prefix(cells, prompt)
                if n >= at_least and (best is None or n > best[1]):
                    best = (seq_id, n)
        return best

    def _evict_one(self, *, keep: Session | None, into: list[int]) -> bool:
        """Drops the least recently used idle named session (never `keep`); False if none."""
        for seq_id, candidate in self._idle_lru.items():
            if candidate is not keep:
                del self._idle_lru[seq_id]
                self._drop(candidate)
                into.append(seq_id)
                self.evicted_total += 1
                return True
        return False

    # -- release (engine thread, or event loop when a request never started) -------------------------

    def mark_ending(self, session: Session) -> None:
        """`session`'s stream was cancelled: the engine will release it at its next step."""
        with self._lock:
            if session.busy:
                self._ending.add(session)

    @property
    def ending(self) -> int:
        """Sessions cancelled and not yet released: capacity about to come back."""
        return len(self._ending)

    def release(self, session: Session, *, keep_kv: bool, retain_cells: bool = False) -> int | None:
        """The request on `session` ended. Returns the seq id to free on the engine, or None if kept.

        `retain_cells`: the sequence is given up but its cells may keep their tokens as a prompt cache
        for the next request that takes this id (None is returned: nothing to free).
        """
        try:
            return self._release(session, keep_kv=keep_kv, retain_cells=retain_cells)
        finally:
            self._released()

    def _release(self, session: Session, *, keep_kv: bool, retain_cells: bool) -> int | None:
        with self._lock:
            self._ending.discard(session)
            session.busy = False
            session.stream_ref = None
            session.last_used = self._clock()
            named = session.session_id is not None and self._named.get(_key(session)) is session
            if keep_kv and named and session in self._live:
                self._reserved_tokens += len(session.tokens) - session.reserved_tokens
                session.reserved_tokens = len(session.tokens)
                self._idle_lru[session.seq_id] = session
                return None
            if session in self._live:
                self._give_up(session)
                if retain_cells:
                    self._leftover[session.seq_id] = _Leftover(
                        session.tenant, session.tokens, session.prefix_blocks,
                        self._kept_until(session) if session.keep > 0 else 0.0, session.batch)
                    return None
                return session.seq_id
            return None

    def _kept_until(self, session: Session) -> float:
        """When the cells `session` leaves stop being kept; past `kept_per_tenant`, its tenant's keep
        that ends soonest ends now. Under the lock."""
        now = self._clock()
        kept = sorted((left.kept_until, seq_id) for seq_id, left in self._leftover.items()
                      if left.tenant == session.tenant and left.kept_until > now)
        for _, seq_id in kept[:max(0, len(kept) - self.kept_per_tenant + 1)]:
            self._leftover[seq_id] = dataclasses.replace(self._leftover[seq_id], kept_until=0.0)
        return now + session.keep

    def _give_up(self, session: Session, *, tombstone: bool = True) -> None:
        """A released sequence is dropped; if the table was full, `_released` announces the room."""
        self._room = len(self._live) >= self.limits.max_sessions
        self._drop(session, tombstone=tombstone)

    def _drop(self, session: Session, *, tombstone: bool = True) -> None:
        self._live.discard(session)
        self._reserved_tokens -= session.reserved_tokens
        session.reserved_tokens = 0
        heapq.heappush(self._free_seq_ids, session.seq_id)
        if session.session_id is not None and self._named.get(_key(session)) is session:
            del self._named[_key(session)]
        if session.session_id is not None and tombstone:
            self._expired[_key(session)] = None
            while len(self._expired) > self._tombstone_limit:
                self._expired.popitem(last=False)

    # -- parking (engine thread) --------------------------------------------------------------------

    def park(self, session: Session) -> int:
        """A running one-shot session gives up its sequence and reservation while the engine keeps its
        cells in host memory; the freed sequence id (its cells are the engine's to clear)."""
        if session.session_id is not None:
            raise ValueError("only one-shot sessions are parked")
        try:
            with self._lock:
                if session not in self._live or not session.busy:
                    raise ValueError("only a running session is parked")
                reserved = session.reserved_tokens
                self._give_up(session, tombstone=False)
                session.reserved_tokens = reserved  # what it takes back when it resumes
                self._parked[session] = None
                return session.seq_id
        finally:
            self._released()

    def unpark(self, session: Session) -> tuple[int, ...] | None:
        """A parked session takes a free sequence (evicting idle kept sessions as an admission would) and
        its reservation again: the evicted sequences' ids, for the engine to clear first; None while
        there is no room (it stays parked). `session.seq_id` is then its new sequence."""
        with self._lock:
            if session not in self._parked:
                raise ValueError("the session is not parked")
            idle_tokens = sum(s.reserved_tokens for s in self._idle_lru.values())
            if (not self._free_seq_ids and not self._idle_lru) or \
                    self._reserved_tokens - idle_tokens + session.reserved_tokens > self.limits.capacity_tokens:
                return None  # checked first: no idle session is evicted for nothing
            freed: list[int] = []
            self._make_room(None, session.reserved_tokens, 1, freed)
            session.seq_id = self._take_seq((), session.tenant)
            session.displaced = _displaced(self._leftover.pop(session.seq_id, None))
            del self._parked[session]
            self._live.add(session)
            self._reserved_tokens += session.reserved_tokens
            return tuple(freed)

    def drop_parked(self, session: Session) -> None:
        """A parked session's request ended (cancelled, past its deadline, the worker stopping): it is
        forgotten; it holds nothing here."""
        with self._lock:
            self._parked.pop(session, None)
            self._ending.discard(session)
            session.busy = False
            session.stream_ref = None
            session.reserved_tokens = 0

    @property
    def parked(self) -> int:
        return len(self._parked)

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

    def delete(self, session_id: str, *, tenant: str = "") -> Session:
        """Forgets `tenant`'s named session of that id (the id may start a new one at once); another
        tenant's session of the same id is no concern of this call: 404 as for an unknown id.

        An idle session is dropped here and its seq id must be freed by the caller; a busy one is
        returned for cancelling, and its release will free it instead of keeping it.
        """
        with self._lock:
            session = self._named.pop((tenant, session_id), None)
            if session is None:
                raise WorkerError(reasons.UNKNOWN_SESSION, f"no session {session_id!r}")
            if not session.busy:
                self._idle_lru.pop(session.seq_id, None)
                self._drop(session, tombstone=False)
            return session

    # -- moving a session's cells (worker/api/transfer.py) ------------------------------------------

    def claim(self, session_id: str, *, tenant: str = "") -> Session:
        """`tenant`'s idle kept session of that id, marked busy so that no request runs on it and no
        admission evicts it while its cells are read; `release(session, keep_kv=True)` gives it back.
        404 `unknown_session` (another tenant's id too), 409 `session_busy`."""
        with self._lock:
            session = self._named.get((tenant, session_id))
            if session is None:
                raise WorkerError(reasons.UNKNOWN_SESSION, f"no session {session_id!r}")
            if session.busy:
                raise WorkerError(reasons.SESSION_BUSY, f"session {session_id!r} is generating")
            self._idle_lru.pop(session.seq_id, None)
            session.busy = True
            return session

    def tokens_of(self, seq_id: int) -> list[int] | None:
        """What sequence `seq_id`'s cells hold (a live session's, or a freed one's leftover), copied;
        None when the table knows nothing of them. Engine thread: the cells hold exactly this."""
        with self._lock:
            live = next((s for s in self._live if s.seq_id == seq_id), None)
            if live is not None:
                return list(live.tokens)
            left = self._leftover.get(seq_id)
            return list(left.tokens) if left is not None else None

    def abandon(self, session: Session) -> int:
        """A session admitted for cells that never came (an import that failed): forgotten as if it had
        never been opened, with no tombstone, its reservation returned. Its seq id, to free."""
        try:
            with self._lock:
                self._ending.discard(session)
                session.busy = False
                session.stream_ref = None
                if session in self._live:
                    self._give_up(session, tombstone=False)
                session.tokens = []
                return session.seq_id
        finally:
            self._released()

    def _released(self) -> None:
        with self._lock:
            room, self._room = self._room, False
        self.on_release()
        if room:
            self.on_room()

    # -- reading -----------------------------------------------------------------------------------

    def stats(self) -> tuple[int, int, int]:
        """(sessions holding a sequence, tokens in KV, tokens reserved)."""
        with self._lock:
            return len(self._live), sum(len(s.tokens) for s in self._live), self._reserved_tokens

    def load(self) -> TableLoad:
        with self._lock:
            idle = self._idle_lru.values()
            return TableLoad(len(self._live), sum(len(s.tokens) for s in self._live), self._reserved_tokens,
                             len(idle), sum(s.reserved_tokens for s in idle),
                             # a request of several choices holds several sessions: listed once
                             tuple(dict.fromkeys(s.stream_ref for s in (*self._live, *self._parked)
                                                 if s.stream_ref is not None)),
                             tuple(key for key, s in self._named.items() if s in self._live),
                             self._prefixes(), dict(self._running_by_tenant()), len(self._parked))

    def running_by_tenant(self) -> Counter[str]:
        """Sequences streaming now, per tenant."""
        with self._lock:
            return self._running_by_tenant()

    def _running_by_tenant(self) -> Counter[str]:
        return Counter(s.tenant for s in self._live if s.busy)

    def _prefixes(self) -> tuple[str, ...]:
        """The prefix blocks of every sequence's cells, running or kept sessions by their last use, then
        leftovers, the most recent first, each block once, at most MAX_HELD_PREFIX_BLOCKS. Under the lock."""
        out: dict[str, None] = {}
        holders = [s.prefix_blocks for s in sorted(self._live, key=lambda s: s.last_used, reverse=True)]
        holders.extend(left.prefix_blocks for left in reversed(self._leftover.values()))
        for blocks in holders:
            for block in blocks:
                out[block] = None
                if len(out) >= MAX_HELD_PREFIX_BLOCKS:
                    return tuple(out)
        return tuple(out)

    def describe(self) -> list[SessionInfo]:
        now = self._clock()
        bpt = self.limits.bytes_per_token
        with self._lock:
            return [
                SessionInfo(session_id=sid, tenant=tenant, tokens=len(s.tokens), kv_bytes=len(s.tokens) * bpt,
                            idle_seconds=0.0 if s.busy else max(0.0, now - s.last_used), busy=s.busy)
                for (tenant, sid), s in self._named.items()
            ]


def _key(session: Session) -> tuple[str, str]:
    """A named session's key in the table: ids are per tenant."""
    assert session.session_id is not None
    return session.tenant, session.session_id


def _displaced(left: _Leftover | None) -> tuple[str, list[int]] | None:
    """What a taken sequence's leftover held, when it is worth saving to host memory (an interactive
    request's); None otherwise."""
    return (left.tenant, left.tokens) if left is not None and not left.batch and left.tokens else None
