"""Tells every coordinator, every interval, that this worker is alive and how loaded it is.

Owns: the heartbeat loop and its HTTP calls, to each coordinator URL at once (several coordinators
serve one pool, each with the whole registry), and, with `resolve_all`, to every address that a URL's
name resolves to at that moment (a Kubernetes headless Service lists one per coordinator pod).
Must not: fail the worker. A coordinator that is down or refuses the heartbeat is logged (once per
change of its state, not every interval) and tried again every REACH_RETRY, not every interval: a
restarted or new coordinator takes client traffic only once it knows the pool (coordinator/ops/
readiness.py), so the sooner it hears from every worker, the sooner it serves. The others are not held
up by it, and get no extra beats.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import socket
import time
from collections.abc import Awaitable, Callable, Sequence
from urllib.parse import urlsplit, urlunsplit

import httpx
from pydantic import ValidationError

from protocol.coordinator import HeartbeatAck
from protocol.health import (
    MAX_HEARTBEAT_TENANTS,
    REACH_RETRY,
    EmbeddingService,
    Heartbeat,
    OfferedModel,
    WorkerLoad,
)
from worker.naming import ModelNames
from worker.settings import MAX_COORDINATORS

log = logging.getLogger("worker.heartbeat")
HEARTBEAT_PATH = "/coordinator/health/heartbeat"
NUDGE_GAP = 0.05  # seconds a nudged beat waits, so a burst of new sessions costs one beat
ROOM_GAP = 0.1  # the least time between two beats when a freed sequence is announced at once
Resolver = Callable[[str, int], Awaitable[list[str]]]


async def resolve(host: str, port: int) -> list[str]:
    """Every address `host` has now (IPv4 and IPv6), each once, in a stable order."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return sorted({str(info[4][0]) for info in infos})


class HeartbeatSender:
    def __init__(self, *, coordinator_urls: Sequence[str], worker_id: str, worker_url: str, names: ModelNames,
                 token: str, interval: float, load: Callable[[], WorkerLoad], model_identity: str = "",
                 embeddings: EmbeddingService | None = None, offered: Sequence[OfferedModel] = (),
                 transport: httpx.AsyncBaseTransport | None = None,
                 resolve_all: bool = False, resolver: Resolver = resolve,
                 wall_clock: Callable[[], float] = time.time) -> None:
        self._bases = [u.rstrip("/") for u in coordinator_urls][:MAX_COORDINATORS]
        self._resolve_all = resolve_all
        self._resolver = resolver
        self._worker_id = worker_id
        self._worker_url = worker_url
        self._names = names
        self._identity = model_identity
        self._embeddings = embeddings
        self.offered = list(offered)  # the folder's models as listed (WorkerRuntime.offer updates it)
        self.swapping = ""  # the model a swap (worker/slots/swapper.py) loads next, while it runs
        self.standby = False  # its model is unloaded, idle past the keep-alive (worker/slots/), and none loaded yet
        self._headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {token}"} if token else {})}
        self._interval = interval
        self._load = load
        self._wall_clock = wall_clock
        # Every call has a deadline shorter than the interval, so beats never pile up.
        self._deadline = min(5.0, interval)
        self._client = httpx.AsyncClient(transport=transport, timeout=self._deadline)
        self._healthy: dict[str, bool] = {}  # by heartbeat URL: its last outcome, for logging changes only
        self._nudged: asyncio.Event | None = None  # made in run(), on the event loop
        self._room = False  # the nudge is for a freed sequence: beat without NUDGE_GAP
        self._pool: dict[str, int] = {}  # by heartbeat URL: the alive workers its last answer counted
        self._waiting: dict[str, list[str]] = {}  # by heartbeat URL: the tenants its last answer said wait
        self.sent = 0

    def freeze(self, load: WorkerLoad) -> None:
        """Every beat from now on says `load` (a swap: the model before is closed, the next not loaded)."""
        self._load = lambda: load

    def heartbeat(self, *, leaving: bool = False) -> Heartbeat:
        waiting = sorted({tenant for tenants in self._waiting.values() for tenant in tenants})
        load = self._load().model_copy(update={"waiting": waiting[:MAX_HEARTBEAT_TENANTS]})
        return Heartbeat(worker_id=self._worker_id, url=self._worker_url, model=self._names.name,
                         aliases=list(self._names.aliases), model_identity=self._identity,
                         embeddings=self._embeddings, load=load, timestamp=self._wall_clock(),
                         pool_workers=max(self._pool.values(), default=0), leaving=leaving, offered=self.offered,
                         swapping=self.swapping, standby=self.standby)

    async def targets(self) -> list[str]:
        """The heartbeat URLs of this interval: each coordinator URL, or each address of its name."""
        urls: list[str] = []
        for base in self._bases:
            if not self._resolve_all:
                urls.append(base + HEARTBEAT_PATH)
                continue
            parts = urlsplit(base)
            host, port = parts.hostname or "", parts.port or (443 if parts.scheme == "https" else 80)
            try:
                async with asyncio.timeout(self._deadline):
                    addresses = await self._resolver(host, port)
            except (OSError, TimeoutError) as exc:
                self._changed(base, False, f"resolving {host!r}: {type(exc).__name__}: {exc}")
                continue
            for address in addresses:
                shown = f"[{address}]" if ipaddress.ip_address(address).version == 6 else address
                urls.append(urlunsplit(parts._replace(netloc=f"{shown}:{port}")) + HEARTBEAT_PATH)
        return list(dict.fromkeys(urls))[:MAX_COORDINATORS]

    async def send_once(self, *, leaving: bool = False) -> bool:
        """One beat to every coordinator at once; True when every one took it. `leaving`: the last one,
        as the worker stops, so that no coordinator sends it more work (coordinator/ops/health.py)."""
        urls = await self.targets()
        body = self.heartbeat(leaving=leaving).model_dump_json()
        results = await asyncio.gather(*(self._send(url, body) for url in urls))
        for gone in set(self._healthy) - set(urls) - set(self._bases):
            del self._healthy[gone]  # an address the name no longer has: bounded by what it resolves to
            self._pool.pop(gone, None)
            self._waiting.pop(gone, None)
        return bool(results) and all(results)

    async def _send(self, url: str, body: str) -> bool:
        try:
            response = await self._client.post(url, content=body, headers=self._headers)
            ok = response.is_success
            problem = f"status {response.status_code}: {response.text[:200]}"
        except httpx.HTTPError as exc:
            ok, problem = False, f"{type(exc).__name__}: {exc}"
        if ok:
            self.sent += 1
            self._pool[url], self._waiting[url] = _answer(response.content)
        else:
            self._pool.pop(url, None)
            self._waiting.pop(url, None)
        self._changed(url, ok, problem)
        return ok

    def _changed(self, url: str, ok: bool, problem: str) -> None:
        if ok == self._healthy.get(url):
            return
        if ok:
            log.info('{"event": "heartbeat_ok", "coordinator": "%s"}', url)
        else:
            log.warning('{"event": "heartbeat_failed", "coordinator": "%s", "problem": "%s"}',
                        url, problem.replace('"', "'"))
        self._healthy[url] = ok

    def nudge(self, *, room: bool = False) -> None:
        """Beat now rather than at the next interval. Event loop only.

        A new named session: every coordinator should know where it is before its next turn can come
        (after NUDGE_GAP, so that a burst costs one beat). `room`: a sequence of a full worker was freed.
        Every coordinator should know at once, not only the one whose stream ended: that one refills it
        the moment its client asks again, and another coordinator's queue would only learn of room
        at the next interval, by when it is gone again. A beat at once, ROOM_GAP after the last at
        the soonest, lets the others' queued requests race for it."""
        if self._nudged is not None:
            self._room = self._room or room
            self._nudged.set()

    async def run(self) -> None:
        self._nudged = asyncio.Event()
        loop = asyncio.get_running_loop()
        while True:
            began = loop.time()
            await self.send_once()
            await self._until_next(began + self._interval)
            if self._nudged.is_set():
                await asyncio.sleep(max(0.0, began + ROOM_GAP - loop.time()) if self._room else NUDGE_GAP)
                self._nudged.clear()
                self._room = False

    async def _until_next(self, due: float) -> None:
        """Waits for the next beat to every coordinator (a nudge, or `due`); meanwhile beats every
        REACH_RETRY to those not reached yet, and with `resolve_all` looks the names up that often, so
        that a new replica's address is reached at once."""
        assert self._nudged is not None
        loop = asyncio.get_running_loop()
        while not self._nudged.is_set() and loop.time() < due:
            wait = due - loop.time()
            if self._resolve_all or not all(self._healthy.values()):
                wait = min(wait, REACH_RETRY)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._nudged.wait(), max(0.0, wait))
            if not self._nudged.is_set() and loop.time() < due:
                await self.reach()

    async def reach(self) -> None:
        """One beat to each coordinator whose last beat failed, or that this worker never beat to."""
        urls = [url for url in await self.targets() if not self._healthy.get(url)]
        if urls:
            body = self.heartbeat().model_dump_json()
            await asyncio.gather(*(self._send(url, body) for url in urls))

    async def aclose(self) -> None:
        await self._client.aclose()


def _answer(answer: bytes) -> tuple[int, list[str]]:
    """What a coordinator's answer says: the alive workers it counts (`HeartbeatAck.workers`) and the
    tenants waiting in its queue; (0, []) when it is not an answer of this protocol."""
    try:
        ack = HeartbeatAck.model_validate_json(answer)
    except ValidationError:
        return 0, []
    return ack.workers, list(ack.waiting)
