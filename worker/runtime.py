"""Assembles a running worker from its settings: model, engine, embedder, session table, gate, background tasks.

Owns: start-up order (load the model off the event loop, size the KV limits from the real context,
start the engine thread, the embedder's thread, the expiry sweeper and the heartbeats) and shutdown
in reverse.
Must not: serve HTTP; app.py does, reading `WorkerRuntime` from `app.state`.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
from collections.abc import Awaitable, Callable, Collection, Sequence
from pathlib import Path
from typing import TypeVar

import httpx

from protocol import reasons
from protocol.health import (
    MAX_HEARTBEAT_TENANTS,
    MAX_SESSIONS,
    EmbeddingService,
    TenantUse,
    WorkerLoad,
    session_digest,
)
from worker.admission import Gate
from worker.backends import build_embedding_context, build_engine
from worker.backends.base import EngineBackend, KvTransfer, ModelBackend, Preemption, PrefixExport
from worker.engine.embedder import Embedder
from worker.engine.jobs import EngineConfig, Failed, Job, Observers
from worker.engine.pacing import CPU_CHUNK, GPU_CHUNK
from worker.errors import WorkerError
from worker.headroom import Headroom
from worker.heartbeat import HeartbeatSender
from worker.ledger import TenantLedger
from worker.metrics import WorkerMetrics
from worker.models import folder
from worker.models.catalog import Offer
from worker.naming import ModelNames
from worker.peers import HttpPeers
from worker.sessions.residency import Residency
from worker.sessions.table import KvLimits, SessionTable
from worker.settings import WorkerSettings

log = logging.getLogger("worker.runtime")
DRAIN_POLL = 0.05
SUPERVISOR_PAUSE, SUPERVISOR_MAX_PAUSE = 0.5, 30.0
DRAIN_FLUSH = 2.0
# A drain waits for the coordinator to move kept sessions only while it does: this long since it last
# listed, exported or ended one (it polls a draining worker every 0.2 s).
HANDOVER_GRACE = 2.0  # for the `error` events of the streams ended at the drain deadline to be sent
# A stop during a load waits this long at most for the load's thread (a model read from disk, a
# context made) before the process goes on exiting without it.
LOAD_STOP_WAIT = 120.0
T = TypeVar("T")
FLASH_ATTN = {"auto": -1, "off": 0, "on": 1}  # WORKER_FLASH_ATTN -> llama.cpp's flash_attn_type


async def whole(work: Callable[[], T], undo: Callable[[T], None], *, wait: float = LOAD_STOP_WAIT) -> T:
    """`work()` (a model's load, a context made on it) on a thread, and its result. Cancelled meanwhile
    (a SIGTERM while the model loads), it waits for the thread, which cannot be stopped, up to `wait`
    seconds, undoes what it made, and is cancelled: before (issue 50), the model was freed while the
    thread was still making a context from it (`Segmentation fault`), or the process exited under the
    thread (`Aborted`)."""
    running = asyncio.ensure_future(asyncio.to_thread(work))
    try:
        return await asyncio.shield(running)
    except asyncio.CancelledError:
        deadline = asyncio.get_running_loop().time() + wait
        while not running.done() and (left := deadline - asyncio.get_running_loop().time()) > 0:
            with contextlib.suppress(asyncio.CancelledError):  # a second cancel does not cut the wait short
                await asyncio.wait([running], timeout=left)
        if not running.done():
            log.error(json.dumps({"event": "stop_during_load", "detail": f"the load still runs after {wait:g} s; "
                                  "the process exits under it"}))
        elif not running.cancelled() and running.exception() is None:
            try:
                undo(running.result())
            except Exception:  # the stop goes on: what was not undone goes with the process
                log.exception("undoing a load cut short failed")
        raise


def bind_gauges(metrics: WorkerMetrics, runtimes: Callable[[], Sequence[WorkerRuntime]]) -> None:
    """The worker's gauges read from `runtimes` (those of the models served now), added up: the KV ones
    as a share of all their caches."""
    def total(read: Callable[[WorkerRuntime], float]) -> Callable[[], float]:
        return lambda: sum(read(r) for r in runtimes())

    def share(read: Callable[[WorkerRuntime], float]) -> Callable[[], float]:
        def shared() -> float:
            served = runtimes()
            capacity = sum(r.table.limits.capacity_tokens for r in served)
            return sum(read(r) for r in served) / capacity if capacity else 0.0
        return shared

    metrics.bind(
        running=total(lambda r: r.engine.running), waiting=total(lambda r: r.engine.queue_depth),
        kv_usage=share(lambda r: r.table.stats()[1]), kv_reserved=share(lambda r: r.table.stats()[2]),
        sessions=total(lambda r: r.table.stats()[0]), expired=total(lambda r: r.table.expired_total),
        evicted=total(lambda r: r.table.evicted_total),
        embeddings_held=total(lambda r: r.embedder.held if r.embedder is not None else 0),
        parked=total(lambda r: r.table.parked))


class WorkerRuntime:
    def __init__(self, settings: WorkerSettings, model: ModelBackend, metrics: WorkerMetrics, *,
                 clock: Callable[[], float], owns_model: bool = True, offers: Sequence[Offer] = ()) -> None:
        """`owns_model`: `stop` closes the model (not when it was handed in to outlive this runtime).
        `offers`: the models of its folder (`--model-dir`; worker/models/folder.py), listed in its heartbeats."""
        self.settings = settings
        self.model = model
        self._owns_model = owns_model
        self._offers = list(offers)
        self.metrics = metrics
        self.names = ModelNames.choose(configured=settings.model_name, configured_aliases=settings.model_aliases,
                                       general_name=model.meta_str("general.name"),
                                       file_stem=settings.model_path.stem if settings.engine == "llama" else model.name)
        config = EngineConfig(ctx_size=settings.ctx_size, max_sessions=settings.max_sessions,
                              threads=settings.threads,
                              prefill_chunk=settings.prefill_chunk or (GPU_CHUNK if model.gpu_layers else CPU_CHUNK),
                              prefill_stall=settings.prefill_stall,
                              kv_unified=settings.kv_unified, flash_attn=FLASH_ATTN[settings.flash_attn],
                              slow_consumer_deadline=settings.slow_consumer_deadline,
                              wake_interval=settings.stream_interval,
                              request_timeout=settings.request_timeout, prompt_cache=settings.prompt_cache,
                              prefix_min_tokens=settings.prefix_min_tokens,
                              host_cache_bytes=settings.host_cache_mib * 1024 * 1024,
                              cut_batch_steps=settings.cut_batch_steps, batch_slowdown=settings.batch_slowdown)
        # The table is sized from the context llama.cpp actually made, not from what we asked for.
        self.ledger = TenantLedger()  # what each tenant was served here, for the heartbeats
        self.engine: EngineBackend = build_engine(settings, model, config, observer=Observers(metrics, self.ledger),
                                                  clock=clock)
        # What it can do beyond every engine's part (backends/base.py), found once.
        self._cells = self.engine if isinstance(self.engine, KvTransfer) else None
        self._prefixes = self.engine if isinstance(self.engine, PrefixExport) else None
        self._preemption = self.engine if isinstance(self.engine, Preemption) else None
        limits = KvLimits(capacity_tokens=self.engine.ctx_tokens,
                          session_max_tokens=min(settings.session_max_tokens, self.engine.seq_tokens,
                                                 model.shape.n_ctx_train),
                          max_sessions=settings.max_sessions, bytes_per_token=model.bytes_per_token)
        self.table = SessionTable(limits, clock, ttl=settings.session_ttl)
        self.engine.bind(self.table)
        # A second context on the same weights, with its own thread: embeddings never enter the decode loop.
        context = build_embedding_context(settings, model)
        self.embedder = None if context is None else Embedder(
            context, lambda text: model.tokenize(text, add_special=True), capacity=settings.embedding_queue,
            timeout=settings.embedding_timeout, observer=metrics, clock=clock)
        self.peers = HttpPeers(token=settings.worker_token, min_tokens=settings.peer_prefix_min_tokens,
                               timeout=settings.peer_prefix_timeout, max_bytes=settings.kv_transfer_max_bytes,
                               metrics=metrics)
        self.gate = Gate(model, self.names, self.table, self.engine, stream_buffer=settings.stream_buffer,
                         clock=clock, embedder=self.embedder, peers=self.peers, cells=self._cells,
                         room_wait=settings.room_wait_seconds, preemption=self._preemption,
                         headroom=Headroom(settings.max_sessions, clock))
        self.table.on_release = self.gate.released
        self.transfer_slots = asyncio.Semaphore(settings.kv_transfers)  # sessions' KV moving at once
        self.handover_seen = 0.0  # loop time the coordinator last moved kept sessions away (`handed_over`)
        self._tasks: list[asyncio.Task[None]] = []
        self.jobs: set[Job] = set()  # the jobs whose stream is open (app.py keeps it), for the drain
        self._clock = clock
        self.used_at = clock()  # when a request last ended here (`used`), or the runtime was made
        # How long its model stays loaded once idle: the operator's keep-alive, lengthened by the tenants'
        # requests within the operator's bound (worker/sessions/residency.py).
        self.residency = Residency(settings.keep_alive, settings.keep_alive_max)
        self.heartbeats: HeartbeatSender | None = None
        self._beating: asyncio.Task[None] | None = None
        bind_gauges(metrics, lambda: (self,))

    def cells(self) -> KvTransfer:
        """The engine, as one whose cells can move; 400 when its backend cannot (checked per call, from
        what `isinstance` found at start)."""
        if self._cells is None:
            raise WorkerError(reasons.INVALID_REQUEST, f"this worker's engine ({self.settings.engine}) holds no "
                              "KV cells that can move")
        return self._cells

    def prefix_cells(self) -> PrefixExport:
        """The engine, as one that exports a prompt's prefix; 400 when its backend cannot."""
        if self._prefixes is None:
            raise WorkerError(reasons.INVALID_REQUEST, f"this worker's engine ({self.settings.engine}) exports "
                              "no prompt prefixes")
        return self._prefixes

    def embedding_service(self) -> EmbeddingService | None:
        """What heartbeats and health say about the embeddings served here; None: none are."""
        if self.embedder is None:
            return None
        context = self.embedder.context
        return EmbeddingService(dimensions=context.dimensions, max_tokens=context.max_tokens,
                                pooling=context.pooling, capacity=self.embedder.capacity)

    def load(self) -> WorkerLoad:
        table = self.table.load()
        limits = self.table.limits
        return WorkerLoad(
            sessions=table.sessions, max_sessions=limits.max_sessions, active_streams=self.engine.active,
            queue_depth=self.engine.queue_depth, kv_used_bytes=table.used_tokens * limits.bytes_per_token,
            kv_reserved_bytes=table.reserved_tokens * limits.bytes_per_token,
            kv_capacity_bytes=limits.capacity_tokens * limits.bytes_per_token,
            bytes_per_token=limits.bytes_per_token, session_max_tokens=limits.session_max_tokens,
            idle_sessions=table.idle_sessions, idle_kv_bytes=table.idle_reserved_tokens * limits.bytes_per_token,
            streams=list(table.stream_refs), held=[session_digest(tenant, sid) for tenant, sid in table.held],
            parkable=min(self._preemption.parkable, table.sessions) if self._preemption is not None else 0,
            parked=table.parked,
            prefixes=list(table.prefixes), tenants=self._tenants(table.running_by_tenant),
            max_prompt_bytes=min(limits.session_max_tokens * self.model.max_token_bytes, 1 << 50),
            draining=self.gate.draining, backend="gpu" if self.model.backend == "gpu" else "cpu",
            gpu_layers=min(self.model.gpu_layers, self.model.shape.n_layer + 1))  # "all" is a huge number

    def _tenants(self, running: dict[str, int]) -> list[TenantUse]:
        """Each tenant's use here, those with the most running first, then the most served; bounded."""
        served = self.ledger.totals()
        uses = [TenantUse(tenant=t, running=min(running.get(t, 0), MAX_SESSIONS), prompt_tokens=prompt,
                          generated_tokens=generated)
                for t, (prompt, generated) in ((t, served.get(t, (0, 0))) for t in set(running) | set(served))]
        uses.sort(key=lambda u: (-u.running, -(u.prompt_tokens + u.generated_tokens)))
        return uses[:MAX_HEARTBEAT_TENANTS]

    async def start(self, transport: httpx.AsyncBaseTransport | None = None) -> None:
        self.engine.start(asyncio.get_running_loop())
        self.peers.open(transport)
        if self.embedder is not None:
            self.embedder.start()
        self._tasks.append(asyncio.create_task(self._supervised("session_sweeper", self._sweep)))
        s = self.settings
        if s.coordinator_urls:
            self.heartbeats = HeartbeatSender(
                coordinator_urls=s.coordinator_urls, worker_id=s.worker_id, worker_url=s.worker_url,
                names=self.names, token=s.worker_token, interval=s.heartbeat_interval,
                load=self.load, model_identity=self.model.identity, embeddings=self.embedding_service(),
                offered=folder.listed(self._offers, s.model_path, self.names), transport=transport, resolve_all=s.coordinator_resolve_all)
            self.table.on_named = self.heartbeats.nudge
            if s.room_wait_seconds > 0:  # several coordinators: each learns of a freed sequence at once
                loop, room = asyncio.get_running_loop(), functools.partial(self.heartbeats.nudge, room=True)

                def announce() -> None:  # any thread (the engine's)
                    loop.call_soon_threadsafe(room)

                self.table.on_room = announce
            self._beating = asyncio.create_task(self._supervised("heartbeats", self.heartbeats.run))
            self._tasks.append(self._beating)

    async def end_beats(self) -> None:
        """After `stop(leaving=False)`: its heartbeats end (the next model's runtime beats now)."""
        if self._beating is not None:
            self._beating.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._beating
        if self.heartbeats is not None:
            await self.heartbeats.aclose()

    def used(self, tenant: str = "") -> None:
        """A request of `tenant` ended here (worker/api/routes.py): the keep-alives count from now."""
        self.used_at = self._clock()
        self.residency.used(tenant, self.used_at)

    def asked_keep_alive(self, tenant: str, seconds: float) -> None:
        """A request of `tenant` asked its model to stay `seconds` once idle (Ollama's `keep_alive`;
        negative: for good): its tenant's stay, within the operator's bound, never shortening another's."""
        self.residency.ask(tenant, seconds, self._clock())

    @property
    def keep_alive(self) -> float | None:
        """Seconds idle (`idle_for`) after which its model may be unloaded (worker/slots/swapper.py); None:
        never."""
        return self.residency.idle_allowed(self.used_at, self._clock())

    def idle_for(self) -> float:
        """Seconds since a request last ended here, while none runs and no session is kept (a kept
        session is used until its TTL ends it); 0 while busy."""
        if self.jobs or self.table.stats()[0] or (self.embedder is not None and self.embedder.held):
            return 0.0
        return max(0.0, self._clock() - self.used_at)

    def offer(self, offers: Sequence[Offer], beside: Collection[Path] = ()) -> None:
        """The folder as read again (worker/slots/swapper.py's watch): the heartbeats list these from now on,
        those in `beside` as loading beside the models served (`folder.listed`); in standby, none as loaded."""
        self._offers = list(offers)
        if self.heartbeats is not None:
            served = None if self.heartbeats.standby else self.settings.model_path
            self.heartbeats.offered = folder.listed(self._offers, served, self.names, beside)

    def stand_by(self, offers: Sequence[Offer]) -> None:
        """Unloaded, the last model served (worker/slots/swapper.py): from its drain's first beat its heartbeats
        say `standby`, listing `offers` with none loaded, so no coordinator sends it more."""
        if self.heartbeats is not None:
            self.heartbeats.standby = True
        self.offer(offers)

    def swapping_to(self, model: str) -> None:
        """A swap to `model` drains it (worker/slots/swapper.py; "": none now): its refusals say so (503
        `model_swapping`, not `draining`), and its heartbeats, from the drain's first."""
        self.gate.swapping = model
        if self.heartbeats is not None:
            self.heartbeats.swapping = model

    async def _supervised(self, task: str, run: Callable[[], Awaitable[None]]) -> None:
        """Runs a background loop for the worker's life: an unexpected exception is logged with its
        traceback, counted (worker_internal_errors_total{task}), and the loop starts again after a
        pause that doubles up to SUPERVISOR_MAX_PAUSE, instead of the task dying silently (a worker
        whose heartbeats stopped would look dead to the coordinator while it still served)."""
        pause = SUPERVISOR_PAUSE
        while True:
            try:
                await run()
                return
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception(json.dumps({"event": "internal_error", "task": task, "restart_in_s": pause}))
                self.metrics.internal_error(task)
                await asyncio.sleep(pause)
                pause = min(pause * 2, SUPERVISOR_MAX_PAUSE)

    async def _sweep(self) -> None:
        while True:
            await asyncio.sleep(self.settings.sweep_interval)
            expired = self.table.expire_idle()
            if expired:
                self.engine.free(expired)
                log.info('{"event": "sessions_expired", "count": %d}', len(expired))

    async def drain(self, timeout: float) -> None:
        """SIGTERM: refuse new requests (503 `draining`) and say so to the coordinator at once, so it
        stops scheduling here; let the open streams finish up to `timeout`; end the rest with an
        `error` event (reason `draining`), which also frees their KV."""
        loop = asyncio.get_running_loop()
        self.gate.draining = True
        running = len(self.jobs)
        log.warning(json.dumps({"event": "draining", "streams": running, "timeout_s": timeout}))
        if self.heartbeats is not None:
            await self.heartbeats.send_once()
        deadline = loop.time() + timeout
        while self.jobs and loop.time() < deadline:
            await asyncio.sleep(DRAIN_POLL)
        ended = len(self.jobs)
        for job in list(self.jobs):
            job.channel.push(Failed(reasons.DRAINING, f"the worker is shutting down; the stream ran past its "
                                                      f"{timeout:g} s drain deadline"), terminal=True)
            job.channel.cancel()  # the engine frees its sequence at its next step
            job.channel.wake()
        self.engine.poke()
        flush_deadline = loop.time() + DRAIN_FLUSH
        while self.jobs and loop.time() < flush_deadline:
            await asyncio.sleep(DRAIN_POLL)
        kept = await self._hand_over(deadline)
        log.warning(json.dumps({"event": "drained", "streams_finished": running - ended, "streams_ended": ended,
                                "sessions_left": kept}))

    async def _hand_over(self, deadline: float) -> int:
        """With a coordinator, the kept sessions are its to move elsewhere (coordinator/pool/moves.py: it
        sees `draining` in the heartbeats, exports each one and ends it here): wait for them to go, up
        to the drain deadline. Returns how many are left (lost as they always were: 404 later)."""
        loop = asyncio.get_running_loop()
        if self.heartbeats is None:
            return len(self.table.describe())
        started = loop.time()
        while self.table.describe() and loop.time() < deadline:
            if loop.time() - max(started, self.handover_seen) > HANDOVER_GRACE:
                break  # nobody is moving them (no coordinator answering, no worker with room): stop waiting
            await asyncio.sleep(DRAIN_POLL)
        return len(self.table.describe())

    def discard(self) -> None:
        """Undoes a runtime built and never started (its load was cancelled: `whole`): its engine's and
        embedder's contexts are freed; the model is its loader's to close."""
        self.engine.stop()
        if self.embedder is not None:
            self.embedder.stop()

    def handed_over(self) -> None:
        """The coordinator listed, exported or ended kept sessions: a drain waits on while it does."""
        self.handover_seen = asyncio.get_running_loop().time()

    async def stop(self, *, leaving: bool = True) -> None:
        """Stops everything and closes the model (when it owns it). `leaving`: its last heartbeat says the
        worker stops. Without (a swap, worker/slots/swapper.py): the heartbeats go on until `end_beats`,
        each saying the worker drains and holds nothing, so that every coordinator keeps it, and its
        folder's offers, while the next model loads."""
        self.gate.draining = True
        beating = None if leaving else self._beating
        if beating is not None and self.heartbeats is not None:
            nothing: dict[str, object] = {name: 0 for name in (
                "sessions", "active_streams", "queue_depth", "kv_used_bytes", "kv_reserved_bytes", "idle_sessions",
                "idle_kv_bytes", "parkable", "parked")}
            self.heartbeats.freeze(self.load().model_copy(update={
                **nothing, "streams": [], "held": [], "prefixes": [], "tenants": [], "draining": True}))
        for task in self._tasks:
            if task is not beating:
                task.cancel()
        for task in self._tasks:
            if task is not beating:
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        if self.heartbeats is not None and beating is None:
            await self.heartbeats.send_once(leaving=True)  # each call has its deadline (< 5 s)
            await self.heartbeats.aclose()
        await self.peers.aclose()
        await asyncio.to_thread(self.engine.stop)
        if self.embedder is not None:
            await asyncio.to_thread(self.embedder.stop)
        if self._owns_model:
            self.model.close()
