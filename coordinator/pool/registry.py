"""Heartbeat registry: every known worker, its state, and O(1) sums of the alive workers' capacity.

Owns: worker records; the alive -> stale -> removed transitions; per-model and global aggregates,
kept up to date on every change so reading them never loops over workers (embedding slots too: a
worker that serves embeddings offers `capacity` of them, less this coordinator's embedding requests
on it, `hold_embedding`); and *corrections*, the
coordinator's in-flight reservations laid on top of a worker's last reported load until a later
heartbeat shows them.
Must not: decide admission, pick workers or do I/O (admission/, scheduling/, relay/ do).

Why corrections: a heartbeat says what a worker held when it was made. A reservation made after
that is invisible to it, so without a correction two requests in the same interval would both see
an idle worker; and a stream that ended since is still in it. Each of this coordinator's streams
carries a reference (`X-Stream-Ref`, the reservation's key), and every heartbeat lists the
references of the streams it counts (`load.streams`). So a correction knows exactly whether the
latest heartbeat counts its stream:
- a running stream (LIVE), or one whose named session stays on the worker (KEPT), adds its amount
  when the heartbeat does not list it, and nothing when it does;
- an ended stream (ENDED) takes its amount off when the heartbeat still lists it, and nothing when
  it does not.
A KEPT or ENDED correction is forgotten once a heartbeat made after the end no longer lists it
(ENDED waits RELEASE_LAG more: a request the client left during its admission may still be admitted
and listed a moment later), or after a few heartbeats whatever their stamps (a worker clock behind
ours, a stream the worker still holds: its report is the truth then).
"""

from __future__ import annotations

import math
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

from protocol import reasons
from protocol.health import EmbeddingService, Heartbeat, OfferedModel, WorkerLoad

ALIVE = "alive"
STALE = "stale"
MODELS_REMEMBERED = 256  # models whose workers all went away, still answered as "unavailable"
RELEASE_LAG = 0.5  # seconds an ended stream's reference may still turn up in a heartbeat
LIVE, KEPT, ENDED = "live", "kept", "ended"
BEATS_KEPT = 2  # heartbeats after its end that a KEPT correction outlives at most
BEATS_ENDED = 3  # and an ENDED one


@dataclass(slots=True)
class Correction:
    """One of this coordinator's streams on a worker, relative to the worker's latest report."""

    kv_bytes: int
    sessions: int
    state: str = LIVE
    ended_at: float = math.inf  # wall time of the stream's end (KEPT, ENDED)
    beats: int = 0  # heartbeats received since its end

    def effect(self, listed: bool) -> tuple[int, int]:
        """(KV bytes, sessions) to add to a report that does or does not list this stream."""
        if self.state == ENDED:
            return (-self.kv_bytes, -self.sessions) if listed else (0, 0)
        return (0, 0) if listed else (self.kv_bytes, self.sessions)

    def outlived(self, listed: bool, stamp: float) -> bool:
        """Whether a heartbeat stamped `stamp` makes this correction redundant (counted after `beats`)."""
        if self.state == LIVE:
            return False
        if self.state == KEPT:
            return (not listed and stamp >= self.ended_at) or self.beats >= BEATS_KEPT
        return (not listed and stamp >= self.ended_at + RELEASE_LAG) or self.beats >= BEATS_ENDED


@dataclass(slots=True)
class WorkerRecord:
    worker_id: str
    url: str
    model: str
    load: WorkerLoad
    last_seen: float  # coordinator monotonic seconds
    state: str = ALIVE
    aliases: tuple[str, ...] = ()
    model_identity: str = ""  # what the model is beyond its name (the worker's digest of its file)
    # Circuit breaker state, written by coordinator/pool/breaker.py; the scheduler's filter reads it.
    breaker_open_until: float = 0.0
    breaker_probing: bool = False
    breaker_failures: int = 0  # in a row
    breaker_trips: int = 0  # times opened since it last closed
    # The coordinator's own view, for the named routing policies.
    in_flight: int = 0  # reservations held on it now (admission/capacity.py)
    picked_at: float = 0.0  # when admission last reserved on it: score ties go to the least recent
    ttft_ewma: float | None = None  # recent time to first token, seconds (gateway.py)
    ttft_at: float = 0.0
    embeddings: EmbeddingService | None = None  # what it says it embeds; None: it does not
    offered: tuple[OfferedModel, ...] = ()  # the models of its folder (--model-dir), as its latest heartbeat says
    swapping: str = ""  # the model of its folder it swaps to now (it drains, then loads it); "": none
    standby: bool = False  # its model unloaded after its keep-alive, none loaded: it serves nothing now
    swap_began: float = 0.0  # when a heartbeat first said `swapping` (coordinator monotonic seconds)
    last_swap_s: float | None = None  # its last swap, drain and load, from its heartbeats; None: none seen
    swap_ended: float = -math.inf  # when a heartbeat first no longer said `swapping` (monotonic seconds)
    embedding_requests: int = 0  # this coordinator's embedding requests on it now (hold_embedding)
    held: frozenset[str] = frozenset()  # session digests in its latest heartbeat (Registry._holder)
    # Capacity refusals since its last heartbeat, from a worker that other coordinators use too: it
    # knows of their streams, so until it reports again (`Registry.refused`) it counts here as having
    # no free session (sessions_full), and less free KV than the refused request needed (kv_full: at
    # most `kv_free_below` - 1 bytes).
    sessions_refused: bool = False
    kv_free_below: int | None = None

    def observe_ttft(self, seconds: float, now: float, weight: float = 0.3) -> None:
        self.ttft_ewma = seconds if self.ttft_ewma is None else (1 - weight) * self.ttft_ewma + weight * seconds
        self.ttft_at = now
    extra_kv_bytes: int = 0
    extra_sessions: int = 0
    corrections: dict[int, Correction] = field(default_factory=dict)
    listed: frozenset[int] = frozenset()  # the stream references in the latest heartbeat
    # What this record added to the aggregates while alive, so it can be taken out exactly.
    counted: tuple[int, ...] = ()

    @property
    def sessions(self) -> int:
        if self.sessions_refused:
            return self.max_sessions
        return max(0, self.load.sessions + self.extra_sessions)

    @property
    def max_sessions(self) -> int:
        return self.load.max_sessions

    @property
    def idle_sessions(self) -> int:
        """Sessions kept for a next turn with no stream: the worker evicts them for a new request."""
        return 0 if self.sessions_refused else min(self.load.idle_sessions, self.sessions)

    @property
    def preemptible(self) -> int:
        """Batch requests an interactive one may still park here: what the worker said it could park, less
        the requests placed here beyond its sequences since (this coordinator's, not yet reported)."""
        if self.sessions_refused:
            return 0
        over = max(0, self.sessions - self.idle_sessions - self.max_sessions)
        return max(0, self.load.parkable - over)

    @property
    def idle_kv_bytes(self) -> int:
        return 0 if self.kv_free_below is not None else min(self.load.idle_kv_bytes, self.kv_reserved_bytes)

    @property
    def kv_reserved_bytes(self) -> int:
        reported = max(self.load.kv_reserved_bytes, self.load.kv_used_bytes)
        reserved = max(0, reported + self.extra_kv_bytes)
        if self.kv_free_below is not None:
            return max(reserved, self.kv_capacity_bytes - self.kv_free_below + 1)
        return reserved

    @property
    def kv_capacity_bytes(self) -> int:
        return self.load.kv_capacity_bytes

    @property
    def bytes_per_token(self) -> int:
        return self.load.bytes_per_token

    @property
    def session_max_tokens(self) -> int:
        return self.load.session_max_tokens

    @property
    def draining(self) -> bool:
        return self.load.draining

    @property
    def embedding_capacity(self) -> int:
        """Embedding requests it holds at once; 0: it serves none."""
        return self.embeddings.capacity if self.embeddings is not None else 0

    def contribution(self) -> tuple[int, ...]:
        """What this worker adds to the sums: (workers, free sessions, session capacity, free KV
        bytes, KV capacity, bytes per token, session max tokens, longest prompt in bytes, workers
        serving embeddings, free embedding slots, batch requests an interactive one may park)."""
        free_sessions = max(0, self.max_sessions - self.sessions + self.idle_sessions)
        free_kv = max(0, self.kv_capacity_bytes - self.kv_reserved_bytes + self.idle_kv_bytes)
        return (1, free_sessions, self.max_sessions, free_kv, self.kv_capacity_bytes,
                self.bytes_per_token, self.session_max_tokens, self.load.max_prompt_bytes,
                int(self.embeddings is not None), max(0, self.embedding_capacity - self.embedding_requests),
                self.preemptible)


@dataclass(slots=True)
class Totals:
    """Sums over alive workers; `bytes_per_token`, `session_max_tokens` and `max_prompt_bytes` count distinct values
    (one per model in practice), so their max is O(distinct values), not O(workers)."""

    workers: int = 0
    free_sessions: int = 0
    max_sessions: int = 0
    free_kv_bytes: int = 0
    kv_capacity_bytes: int = 0
    bytes_per_token: Counter[int] = field(default_factory=Counter)
    session_max_tokens: Counter[int] = field(default_factory=Counter)
    max_prompt_bytes: Counter[int] = field(default_factory=Counter)  # 0: a worker that reports none
    embedding_workers: int = 0  # of `workers`, those serving embeddings
    free_embedding_slots: int = 0
    preemptible: int = 0  # batch requests that interactive ones may park

    def apply(self, values: tuple[int, ...], sign: int) -> None:
        self.workers += sign * values[0]
        self.free_sessions += sign * values[1]
        self.max_sessions += sign * values[2]
        self.free_kv_bytes += sign * values[3]
        self.kv_capacity_bytes += sign * values[4]
        self.embedding_workers += sign * values[8]
        self.free_embedding_slots += sign * values[9]
        self.preemptible += sign * values[10]
        for counter, key in ((self.bytes_per_token, values[5]), (self.session_max_tokens, values[6]),
                             (self.max_prompt_bytes, values[7])):
            counter[key] += sign
            if counter[key] <= 0:
                del counter[key]


class Registry:
    def __init__(self, *, stale_after: float, dead_after: float,
                 on_removed: Callable[[WorkerRecord], None] | None = None,
                 on_identity_gone: Callable[[str], None] = lambda identity: None) -> None:
        """`on_identity_gone`: no known worker reports that model identity any more (the response
        cache drops its entries)."""
        self.stale_after = stale_after
        self.dead_after = dead_after
        self._on_removed = on_removed
        self._on_identity_gone = on_identity_gone
        self._workers: dict[str, WorkerRecord] = {}
        # Which worker holds each session, by `protocol.health.session_digest`, from the workers' own
        # heartbeats: right whichever coordinator served the session's last turn (or moved it).
        # Bounded by the sessions the known workers hold.
        self._holder: dict[str, str] = {}
        # Both ordered by last_seen (a heartbeat moves its worker to the end), so a sweep only
        # looks at the workers that are about to change state.
        self._alive: OrderedDict[str, WorkerRecord] = OrderedDict()
        self._stale: OrderedDict[str, WorkerRecord] = OrderedDict()
        self._alive_by_model: dict[str, dict[str, WorkerRecord]] = {}
        self._models_known: Counter[str] = Counter()
        # Model -> the identities its workers report, counted by worker (a swap shows two for a while).
        self._identities: dict[str, Counter[str]] = {}
        # Public name (a model's own or an alias) -> the models known under it, counted by worker.
        self._names: dict[str, Counter[str]] = {}
        # Models whose last worker was removed, so a request for one hears "unavailable", not "unknown".
        self._gone: OrderedDict[str, None] = OrderedDict()
        self.total = Totals()
        self._by_model: dict[str, Totals] = {}

    # --- reads (O(1)) -----------------------------------------------------------------------
    def get(self, worker_id: str) -> WorkerRecord | None:
        return self._workers.get(worker_id)

    def totals(self, model: str | None) -> Totals | None:
        return self.total if model is None else self._by_model.get(model)

    def knows_model(self, model: str) -> bool:
        """Some worker (alive or stale) serves it."""
        return model in self._models_known

    def served_lately(self, model: str) -> bool:
        """Some worker serves it, or did until recently (a request for it is "unavailable", not "unknown")."""
        return model in self._models_known or model in self._gone

    def resolve(self, name: str) -> str | None:
        """The model a request's `model` names: a model itself, or an alias of one (the model with
        most workers when several share it), or a model whose workers all went away recently."""
        if name in self._models_known:
            return name
        owners = self._names.get(name)
        if owners:
            return min(owners, key=lambda model: (-owners[model], model))
        return name if name in self._gone else None

    def known_models(self) -> list[str]:
        """Models some worker (alive or stale) serves now."""
        return sorted(self._models_known)

    def identity_of(self, model: str) -> str:
        """What the workers known under `model` serve, beyond its name: their identities, joined (a
        pool in the middle of a model swap has two). O(identities of one model)."""
        return "|".join(sorted(self._identities.get(model, ())))

    def aliases_of(self, model: str) -> list[str]:
        return sorted(name for name, owners in self._names.items() if model in owners and name != model)

    def alive_models(self) -> list[str]:
        """Models an alive worker serves (its model loaded: a worker in standby serves none)."""
        return sorted(model for model, workers in self._alive_by_model.items()
                      if any(not w.standby for w in workers.values()))

    def offered_models(self) -> dict[str, list[str]]:
        """Models alive workers offer from their folders (--model-dir) that none of them serves now, each
        with the workers that offer it. O(alive workers x their offers): for listings and refusals."""
        serving = set(self.alive_models())
        found: dict[str, list[str]] = {}
        for rec in self._alive.values():
            for offer in rec.offered:
                if offer.state == "offered" and offer.name not in serving:
                    found.setdefault(offer.name, []).append(rec.worker_id)
        return dict(sorted(found.items()))

    def offered_as(self, name: str) -> str | None:
        """The model `name` names, itself or by an alias, that an alive worker offers from its folder and
        no worker serves undrained: offered, or loaded on a worker swapping away from it (its requests
        wait for a worker to load it again). O(as above, times the model's workers)."""
        return next((offer.name for rec, offer in self._offers_named(name)
                     if (offer.state == "offered" or rec.swapping) and not self._served_undrained(offer.name)), None)

    def offer_named(self, name: str) -> str | None:
        """The model of any alive worker's folder that `name` names, itself or by an alias (a file's stem
        names its model on every worker, even one serving it from another file). O(as above)."""
        return next((offer.name for _, offer in self._offers_named(name)), None)

    def _offers_named(self, name: str) -> Iterator[tuple[WorkerRecord, OfferedModel]]:
        """Each alive worker's offer, offered or loaded, that `name` names."""
        for rec in self._alive.values():
            for offer in rec.offered:
                if offer.state in ("offered", "loaded") and name in (offer.name, *offer.aliases):
                    yield rec, offer

    def swap_involves(self, model: str) -> bool:
        """An alive worker is swapping to `model`, or away from it while offering it: requests for it wait
        for the swap. O(alive workers x their offers)."""
        return any(rec.swapping and (rec.swapping == model or any(o.name == model for o in rec.offered))
                   for rec in self._alive.values())

    def _served_undrained(self, model: str) -> bool:
        return any(not w.draining for w in self._alive_by_model.get(model, {}).values())

    @property
    def alive_count(self) -> int:
        return len(self._alive)

    @property
    def stale_count(self) -> int:
        return len(self._stale)

    # --- reads (O(n), for scheduling and listings) -------------------------------------------
    def alive(self, model: str | None = None) -> Iterable[WorkerRecord]:
        if model is None:
            return self._alive.values()
        return self._alive_by_model.get(model, {}).values()

    def all(self) -> Iterable[WorkerRecord]:
        return self._workers.values()

    # --- writes -------------------------------------------------------------------------------
    def upsert(self, hb: Heartbeat, now: float) -> WorkerRecord:
        rec = self._workers.get(hb.worker_id)
        aliases = tuple(hb.aliases)
        if rec is None:
            rec = WorkerRecord(hb.worker_id, hb.url, hb.model, hb.load, now, state=STALE, aliases=aliases,
                               model_identity=hb.model_identity, listed=frozenset(hb.load.streams),
                               embeddings=hb.embeddings, offered=tuple(hb.offered), swapping=hb.swapping,
                               swap_began=now, standby=hb.standby)
            self._workers[hb.worker_id] = rec
            self._know(rec)
            self._hold(rec, frozenset(hb.load.held))
        else:
            self._leave(rec)
            if (rec.model, rec.aliases, rec.model_identity) != (hb.model, aliases, hb.model_identity):
                before = (rec.model, rec.model_identity)
                self._forget_model(rec)
                rec.model, rec.aliases, rec.model_identity = hb.model, aliases, hb.model_identity
                self._know(rec)
                self._announce_if_gone(*before)  # after: an alias change keeps the identity served
            rec.url, rec.load, rec.last_seen, rec.embeddings = hb.url, hb.load, now, hb.embeddings
            if hb.swapping and not rec.swapping:
                rec.swap_began = now
            elif rec.swapping and not hb.swapping:
                rec.last_swap_s = now - rec.swap_began  # from its first beat saying so to its first after
                rec.swap_ended = now
            rec.offered, rec.swapping, rec.standby = tuple(hb.offered), hb.swapping, hb.standby
            rec.sessions_refused, rec.kv_free_below = False, None  # its own report: what it refused is in it
            self._reflect(rec, frozenset(hb.load.streams), hb.timestamp)
            self._hold(rec, frozenset(hb.load.held))
        self._join(rec)
        return rec

    def sweep(self, now: float) -> None:
        """Move workers whose heartbeats stopped to stale, then out; amortized O(1) per heartbeat."""
        while self._alive:
            rec = next(iter(self._alive.values()))
            if now - rec.last_seen < self.stale_after:
                break
            self._leave(rec)
            rec.state = STALE
            self._stale[rec.worker_id] = rec
        while self._stale:
            rec = next(iter(self._stale.values()))
            if now - rec.last_seen < self.dead_after:
                break
            self.remove(rec.worker_id)

    def lost(self, worker_id: str, now: float) -> None:
        """The worker is gone before its heartbeats could say so: its last beat said it was leaving, or
        its address refused a connection (nothing listens there). It turns stale at once, as if its
        last heartbeat were `stale_after` old, so it is removed `dead_after - stale_after` later; the
        sessions it held are no longer its (`holder`). A heartbeat brings it back, as any stale
        worker. Before: a worker that exited stayed alive, sessions and all, until its beats were
        missed (7 s in issue 33). Amortized O(1), as `sweep`."""
        self.sweep(now)  # those due first, so the stale list stays in last_seen order
        rec = self._workers.get(worker_id)
        if rec is None or rec.state != ALIVE:
            return
        self._leave(rec)
        rec.last_seen = min(rec.last_seen, now - self.stale_after)
        self._stale[rec.worker_id] = rec
        self._hold(rec, frozenset())

    def remove(self, worker_id: str) -> None:
        rec = self._workers.pop(worker_id, None)
        if rec is None:
            return
        self._leave(rec)
        self._stale.pop(worker_id, None)
        self._hold(rec, frozenset())
        self._forget_model(rec)
        self._announce_if_gone(rec.model, rec.model_identity)
        if self._on_removed is not None:
            self._on_removed(rec)

    def holder(self, digest: str) -> str | None:
        """The worker whose latest heartbeat lists the session of that digest, if any."""
        return self._holder.get(digest)

    def _hold(self, rec: WorkerRecord, held: frozenset[str]) -> None:
        for gone in rec.held - held:
            if self._holder.get(gone) == rec.worker_id:  # not if another worker listed it since (a move)
                del self._holder[gone]
        for digest in held:
            self._holder[digest] = rec.worker_id
        rec.held = held

    def refused(self, worker_id: str, reason: str, kv_bytes: int) -> None:
        """`worker_id` refused a request as full: `reasons.SESSIONS_FULL` (no session free), or
        `KV_FULL` for one that needed `kv_bytes`. If its latest heartbeat listed streams that are not
        this coordinator's (another coordinator's: they are why this one's view fell short), it
        counts so in the aggregates and the scheduler's filters until its next heartbeat. Otherwise
        nothing changes: with one coordinator a refusal is a seam (a sequence still ending) that the
        corrections already account for, and marking the worker full would refuse requests it has
        room for (tests/faults/test_churn.py)."""
        rec = self._workers.get(worker_id)
        if rec is None or reason not in (reasons.SESSIONS_FULL, reasons.KV_FULL):
            return
        if rec.listed <= rec.corrections.keys():
            return
        found = rec

        def mark() -> None:
            if reason == reasons.SESSIONS_FULL:
                found.sessions_refused = True
            else:
                found.kv_free_below = min(kv_bytes, found.kv_free_below or kv_bytes)

        self._update(found, mark)

    def correct(self, worker_id: str, key: int, correction: Correction) -> None:
        """Add (or replace) the correction of stream `key` on a worker."""
        rec = self._workers.get(worker_id)
        if rec is not None:
            self._update(rec, lambda: self._set_correction(rec, key, correction))

    def end(self, worker_id: str, key: int, at: float, *, kept_kv_bytes: int | None = None) -> None:
        """Stream `key` ended at wall time `at`; `kept_kv_bytes`: its named session stays on the worker
        holding that much KV."""
        rec = self._workers.get(worker_id)
        corr = rec.corrections.get(key) if rec is not None else None
        if rec is None or corr is None:
            return
        ended = (Correction(kept_kv_bytes, corr.sessions, KEPT, at) if kept_kv_bytes is not None
                 else Correction(corr.kv_bytes, corr.sessions, ENDED, at))
        self._update(rec, lambda: self._set_correction(rec, key, ended))

    def hold_embedding(self, worker_id: str, change: int) -> None:
        """This coordinator sent (+1) or finished (-1) an embedding request on a worker. O(1)."""
        rec = self._workers.get(worker_id)
        if rec is not None:

            def held() -> None:
                rec.embedding_requests = max(0, rec.embedding_requests + change)

            self._update(rec, held)

    # --- internals ----------------------------------------------------------------------------
    def _update(self, rec: WorkerRecord, change: Callable[[], None]) -> None:
        alive = rec.state == ALIVE
        if alive:
            self._count(rec, -1)
        change()
        if alive:
            self._count(rec, +1)

    @staticmethod
    def _set_correction(rec: WorkerRecord, key: int, new: Correction | None) -> None:
        old = rec.corrections.pop(key, None)
        listed = key in rec.listed
        if old is not None:
            kv, sessions = old.effect(listed)
            rec.extra_kv_bytes -= kv
            rec.extra_sessions -= sessions
        if new is not None:
            rec.corrections[key] = new
            kv, sessions = new.effect(listed)
            rec.extra_kv_bytes += kv
            rec.extra_sessions += sessions

    @staticmethod
    def _reflect(rec: WorkerRecord, listed: frozenset[int], stamp: float) -> None:
        """Lay the corrections on a new heartbeat stamped `stamp` listing `listed` (record not counted now)."""
        rec.listed = listed
        rec.extra_kv_bytes = rec.extra_sessions = 0
        for key, corr in list(rec.corrections.items()):
            if corr.state != LIVE:
                corr.beats += 1
            if corr.outlived(key in listed, stamp):
                del rec.corrections[key]
                continue
            kv, sessions = corr.effect(key in listed)
            rec.extra_kv_bytes += kv
            rec.extra_sessions += sessions

    def _join(self, rec: WorkerRecord) -> None:
        self._stale.pop(rec.worker_id, None)
        rec.state = ALIVE
        self._alive[rec.worker_id] = rec
        self._alive.move_to_end(rec.worker_id)
        self._alive_by_model.setdefault(rec.model, {})[rec.worker_id] = rec
        self._count(rec, +1)

    def _leave(self, rec: WorkerRecord) -> None:
        if rec.state != ALIVE:
            return
        self._count(rec, -1)
        del self._alive[rec.worker_id]
        peers = self._alive_by_model[rec.model]
        del peers[rec.worker_id]
        if not peers:
            del self._alive_by_model[rec.model]
        rec.state = STALE

    def _count(self, rec: WorkerRecord, sign: int) -> None:
        values = rec.contribution() if sign > 0 else rec.counted
        per_model = self._by_model.setdefault(rec.model, Totals())
        self.total.apply(values, sign)
        per_model.apply(values, sign)
        if per_model.workers == 0:
            del self._by_model[rec.model]
        if sign > 0:
            rec.counted = values

    def _know(self, rec: WorkerRecord) -> None:
        self._identities.setdefault(rec.model, Counter())[rec.model_identity] += 1
        self._models_known[rec.model] += 1
        self._gone.pop(rec.model, None)
        for name in (rec.model, *rec.aliases):
            self._names.setdefault(name, Counter())[rec.model] += 1

    def _announce_if_gone(self, model: str, identity: str) -> None:
        if identity not in self._identities.get(model, ()):
            self._on_identity_gone(identity)

    def _forget_model(self, rec: WorkerRecord) -> None:
        model = rec.model
        identities = self._identities[model]
        identities[rec.model_identity] -= 1
        if identities[rec.model_identity] <= 0:
            del identities[rec.model_identity]
            if not identities:
                del self._identities[model]
        for name in (model, *rec.aliases):
            owners = self._names[name]
            owners[model] -= 1
            if owners[model] <= 0:
                del owners[model]
                if not owners:
                    del self._names[name]
        self._models_known[model] -= 1
        if self._models_known[model] <= 0:
            del self._models_known[model]
            self._gone[model] = None
            while len(self._gone) > MODELS_REMEMBERED:
                self._gone.popitem(last=False)
