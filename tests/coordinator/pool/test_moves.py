"""A draining worker's kept sessions moved to the model's other workers (coordinator/pool/moves.py),
over fake workers: each goes to one with room (a 503 sends it to the next), its affinity follows it,
the draining worker's copy is ended, and one that cannot move stays where it was."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from coordinator.clock import ManualClock
from coordinator.settings import Settings
from tests.coordinator.fakes import FakeWorkers, done, heartbeat, register, running_app, streaming, token

pytestmark = pytest.mark.anyio
SETTINGS = Settings(heartbeat_interval=1.0, queue_size=0, worker_token="s3cret")
SESSIONS = [{"session_id": "a", "tenant": "", "tokens": 40, "kv_bytes": 4_000, "idle_seconds": 1.0, "busy": False},
            {"session_id": "b", "tenant": "k", "tokens": 30, "kv_bytes": 3_000, "idle_seconds": 1.0, "busy": False},
            {"session_id": "c", "tenant": "", "tokens": 20, "kv_bytes": 2_000, "idle_seconds": 1.0, "busy": False}]


def source(held: list[dict]) -> object:  # type: ignore[type-arg]
    """The draining worker: lists what it still holds, exports a and b (c it cannot), ends what is moved."""
    def behaviour(request: httpx.Request) -> httpx.Response:
        assert request.headers["authorization"] == "Bearer s3cret"
        path = request.url.path
        if path == "/worker/sessions":
            return httpx.Response(200, json={"ttl_seconds": 600, "sessions": held})
        sid = path.split("/")[3]
        if request.method == "GET":
            return httpx.Response(404) if sid == "c" else httpx.Response(200, content=f"blob-{sid}".encode())
        assert request.method == "DELETE"
        held[:] = [s for s in held if s["session_id"] != sid]
        return httpx.Response(204)
    return behaviour


def target(accepts: set[str], taken: list[tuple[str, str, bytes]], worker_id: str) -> object:  # type: ignore[type-arg]
    def behaviour(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/worker/generate":
            return streaming([token(0, worker_id), done(worker_id=worker_id)], worker_id=worker_id)(request)
        sid = request.url.path.split("/")[3]
        if sid not in accepts:
            return httpx.Response(503, json={"error": "no room", "reason": "kv_full", "request_id": "x"})
        taken.append((sid, request.url.params.get("tenant", ""), request.content))
        return httpx.Response(201, json={"session_id": sid, "tokens": 1, "bytes": len(request.content)})
    return behaviour


async def test_a_draining_workers_sessions_go_where_there_is_room_and_their_affinity_follows() -> None:
    held = [dict(s) for s in SESSIONS]
    taken2: list[tuple[str, str, bytes]] = []
    taken3: list[tuple[str, str, bytes]] = []
    clock = ManualClock()
    fakes = FakeWorkers({"w1": source(held), "w2": target({"a"}, taken2, "w2"),  # type: ignore[dict-item]
                         "w3": target({"a", "b"}, taken3, "w3")})  # type: ignore[dict-item]
    async with running_app(SETTINGS, fakes, clock) as client:
        # w2 has the most free KV, so it is asked first; it refuses b (503), which goes to w3.
        for worker_id, reserved in (("w1", 0), ("w2", 0), ("w3", 500_000)):
            beat = heartbeat(worker_id, timestamp=clock.time(), kv_reserved_bytes=reserved)
            assert (await register(client, beat, "s3cret")).status_code == 200
        draining = heartbeat("w1", timestamp=clock.time(), sessions=3, draining=True)
        assert (await register(client, draining, "s3cret")).status_code == 200
        for _ in range(200):
            if not [s for s in held if s["session_id"] != "c"]:
                break
            await asyncio.sleep(0.01)
        assert taken2 == [("a", "", b"blob-a")] and taken3 == [("b", "k", b"blob-b")]
        assert [s["session_id"] for s in held] == ["c"]  # not exported: it stays, and goes with its worker
        # The next turn of a moved session goes to its new worker.
        turn = await client.post("/coordinator/infer", json={"prompt": "next", "session_id": "a"})
        assert turn.status_code == 200 and turn.headers["x-worker-id"] == "w2", turn.text
        metrics = (await client.get("/metrics")).text
        assert 'coordinator_session_moves_total{outcome="moved"} 2.0' in metrics
        assert 'coordinator_session_moves_total{outcome="source_refused"} 1.0' in metrics
        # The status page's snapshot counts them too.
        moves = (await client.get("/coordinator/status")).json()["counters"]["session_moves"]
        assert moves == {"moved": 2, "source_refused": 1}
    deletes = [r.url.path for host, r in fakes.calls if host == "w1" and r.method == "DELETE"]
    assert deletes == ["/worker/sessions/a", "/worker/sessions/b"]


async def test_a_session_no_worker_has_room_for_stays_and_is_counted() -> None:
    held = [dict(SESSIONS[0])]
    clock = ManualClock()
    fakes = FakeWorkers({"w1": source(held), "w2": target(set(), [], "w2")})  # type: ignore[dict-item]
    async with running_app(SETTINGS, fakes, clock) as client:
        for worker_id in ("w1", "w2"):
            assert (await register(client, heartbeat(worker_id, timestamp=clock.time()), "s3cret")).status_code == 200
        await register(client, heartbeat("w1", timestamp=clock.time(), sessions=1, draining=True), "s3cret")
        await asyncio.sleep(0.3)  # tried, and tried again: not given up before the move's deadline
        assert 'outcome="no_room"' not in (await client.get("/metrics")).text
        clock.advance(SETTINGS.session_move_deadline)
        for _ in range(200):
            if 'outcome="no_room"' in (await client.get("/metrics")).text:
                break
            await asyncio.sleep(0.01)
        assert 'coordinator_session_moves_total{outcome="no_room"} 1.0' in (await client.get("/metrics")).text
        # Its next heartbeats still say draining: the drain was dealt with, nothing is tried again.
        for _ in range(3):
            await register(client, heartbeat("w1", timestamp=clock.time(), sessions=1, draining=True), "s3cret")
            await asyncio.sleep(0.05)
        assert 'coordinator_session_moves_total{outcome="no_room"} 1.0' in (await client.get("/metrics")).text
        # Restarted under the same id and drained again: moved again.
        await register(client, heartbeat("w1", timestamp=clock.time(), sessions=1), "s3cret")
        await register(client, heartbeat("w1", timestamp=clock.time(), sessions=1, draining=True), "s3cret")
        await asyncio.sleep(0.05)
        clock.advance(SETTINGS.session_move_deadline)
        for _ in range(200):
            if 'outcome="no_room"} 2.0' in (await client.get("/metrics")).text:
                break
            await asyncio.sleep(0.01)
        assert 'coordinator_session_moves_total{outcome="no_room"} 2.0' in (await client.get("/metrics")).text
    assert held == [SESSIONS[0]]  # still on its worker, not ended there


async def test_a_session_whose_receiver_is_down_for_a_moment_is_moved_once_it_is_back() -> None:
    """Issue 33: the worker receiving a drain's sessions was killed mid-move and beat again 1.4 s later,
    while the draining one lived on; the other sessions had been marked `no_room` within 50 ms and lost."""
    held = [dict(SESSIONS[0])]
    taken: list[tuple[str, str, bytes]] = []
    up = {"w2": False}
    clock = ManualClock()
    receiver = target({"a"}, taken, "w2")

    def restarting(request: httpx.Request) -> httpx.Response:
        if not up["w2"] and request.method == "PUT":
            raise httpx.ConnectError("refused", request=request)
        return receiver(request)  # type: ignore[operator, no-any-return]

    fakes = FakeWorkers({"w1": source(held), "w2": restarting})  # type: ignore[dict-item]
    async with running_app(SETTINGS, fakes, clock) as client:
        for worker_id in ("w1", "w2"):
            assert (await register(client, heartbeat(worker_id, timestamp=clock.time()), "s3cret")).status_code == 200
        await register(client, heartbeat("w1", timestamp=clock.time(), sessions=1, draining=True), "s3cret")
        await asyncio.sleep(0.8)  # a few tries, each refused
        assert taken == [] and held
        up["w2"] = True
        for _ in range(300):
            if not held:
                break
            await asyncio.sleep(0.01)
        assert taken == [("a", "", b"blob-a")] and held == []
        assert 'outcome="no_room"' not in (await client.get("/metrics")).text


async def test_a_receiver_whose_port_refuses_is_out_of_the_pool_until_it_beats_again() -> None:
    """A refused connection means nothing listens there: the restarting receiver is stale at once, so
    no request is sent to it meanwhile, and the move goes on once its next heartbeat brings it back."""
    held = [dict(SESSIONS[0])]
    taken: list[tuple[str, str, bytes]] = []
    clock = ManualClock()
    fakes = FakeWorkers({"w1": source(held), "w2": target({"a"}, taken, "w2")})  # type: ignore[dict-item]
    async with running_app(SETTINGS, fakes, clock) as client:
        for worker_id in ("w1", "w2"):
            assert (await register(client, heartbeat(worker_id, timestamp=clock.time()), "s3cret")).status_code == 200
        fakes.gone.add("w2")  # killed
        await register(client, heartbeat("w1", timestamp=clock.time(), sessions=1, draining=True), "s3cret")
        for _ in range(300):
            if workers(await client.get("/coordinator/health/workers")).get("w2") == "stale":
                break
            await asyncio.sleep(0.01)
        assert workers(await client.get("/coordinator/health/workers"))["w2"] == "stale" and taken == [] and held
        fakes.gone.clear()
        await register(client, heartbeat("w2", timestamp=clock.time()), "s3cret")  # restarted: it beats
        for _ in range(300):
            if not held:
                break
            await asyncio.sleep(0.01)
        assert taken == [("a", "", b"blob-a")] and held == []


def workers(listing: httpx.Response) -> dict[str, str]:
    return {w["worker_id"]: w["state"] for w in listing.json()["workers"]}


def handing_over(held: list[dict], movers: dict[str, str]) -> object:  # type: ignore[type-arg]
    """A draining worker as worker/api/transfer.py is one: a session exported once is that mover's (an
    anonymous mover's, once); another mover's export of it is refused 409."""
    plain = source(held)

    def behaviour(request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if request.method == "GET" and path != "/worker/sessions":
            sid, mover = path.split("/")[3], request.url.params.get("mover", "")
            if sid in movers and (not mover or movers[sid] != mover):
                return httpx.Response(409, json={"error": f"session {sid!r} is being moved by another coordinator",
                                                 "reason": "session_busy", "request_id": "x"})
            movers[sid] = mover
        return plain(request)  # type: ignore[operator, no-any-return]
    return behaviour


async def test_sessions_whose_receiver_was_killed_mid_move_are_moved_once_it_beats_again(
        caplog: pytest.LogCaptureFixture) -> None:
    """Issue 50: the receiver was SIGKILLed mid-move; each session's export had handed it to this
    coordinator, whose next try of it was refused 409 as if another coordinator moved it: 7 of 8
    sessions were marked `source_refused` within a second, while the draining worker lived on and the
    receiver was beating again. Now the same coordinator exports them again, until one lands."""
    held = [dict(SESSIONS[0]), dict(SESSIONS[1]), {**SESSIONS[2], "session_id": "d"}]  # the source exports all
    movers: dict[str, str] = {}
    taken: list[tuple[str, str, bytes]] = []
    killed = {"w2": True}
    clock = ManualClock()
    receiver = target({"a", "b", "d"}, taken, "w2")

    def killed_mid_move(request: httpx.Request) -> httpx.Response:
        if killed["w2"] and request.method == "PUT":
            raise httpx.ReadError("connection reset by peer", request=request)  # the upload was cut
        return receiver(request)  # type: ignore[operator, no-any-return]

    fakes = FakeWorkers({"w1": handing_over(held, movers), "w2": killed_mid_move})  # type: ignore[dict-item]
    caplog.set_level("INFO", logger="coordinator.moves")
    async with running_app(SETTINGS, fakes, clock) as client:
        for worker_id in ("w1", "w2"):
            assert (await register(client, heartbeat(worker_id, timestamp=clock.time()), "s3cret")).status_code == 200
        await register(client, heartbeat("w1", timestamp=clock.time(), sessions=3, draining=True), "s3cret")
        await asyncio.sleep(1.2)  # tried, each put cut, and tried again
        assert taken == [] and len(held) == 3 and set(movers) == {"a", "b", "d"}
        killed["w2"] = False  # restarted, and beating
        for _ in range(300):
            if not held:
                break
            await asyncio.sleep(0.01)
        assert sorted(sid for sid, _, _ in taken) == ["a", "b", "d"] and held == []
        metrics = (await client.get("/metrics")).text
        assert 'coordinator_session_moves_total{outcome="moved"} 3.0' in metrics
        assert "source_refused" not in metrics and "no_room" not in metrics
    deferred = [r.getMessage() for r in caplog.records if "session_move_deferred" in r.getMessage()]
    assert len(deferred) == 3 and all("w2: no answer" in line and "connection reset" in line for line in deferred)


async def test_a_session_not_moved_names_its_cause(caplog: pytest.LogCaptureFixture) -> None:
    """The log of a session given up says why: the draining worker's refusal, its status and reason."""
    held = [dict(SESSIONS[2])]  # c: the source answers 404
    fakes = FakeWorkers({"w1": source(held), "w2": target(set(), [], "w2")})  # type: ignore[dict-item]
    clock = ManualClock()
    async with running_app(SETTINGS, fakes, clock) as client:
        for worker_id in ("w1", "w2"):
            assert (await register(client, heartbeat(worker_id, timestamp=clock.time()), "s3cret")).status_code == 200
        caplog.set_level("INFO", logger="coordinator.moves")
        await register(client, heartbeat("w1", timestamp=clock.time(), sessions=1, draining=True), "s3cret")
        for _ in range(200):
            if "session_not_moved" in caplog.text:
                break
            await asyncio.sleep(0.01)
    not_moved = [r.getMessage() for r in caplog.records if "session_not_moved" in r.getMessage()]
    assert len(not_moved) == 1 and "export: 404" in not_moved[0], not_moved
