"""Heartbeats to several coordinators: every one gets each beat, one that is down holds up none of
the others, and a name is expanded to every address it has (a headless Service) when asked."""

from __future__ import annotations

import asyncio
import json
import logging

import httpx
import pytest

from protocol.health import REACH_RETRY, Heartbeat, WorkerLoad
from worker.heartbeat import HEARTBEAT_PATH, ROOM_GAP, HeartbeatSender
from worker.naming import ModelNames
from worker.settings import MAX_COORDINATORS, WorkerSettings


def load() -> WorkerLoad:
    return WorkerLoad(sessions=0, max_sessions=4, active_streams=0, queue_depth=0, kv_used_bytes=0,
                      kv_reserved_bytes=0, kv_capacity_bytes=1 << 20, bytes_per_token=1024, session_max_tokens=512)


def sender(urls: list[str], handler: object, **kwargs: object) -> HeartbeatSender:
    return HeartbeatSender(coordinator_urls=urls, worker_id="w1", worker_url="http://10.0.0.9:3001",
                           names=ModelNames("m", ()), token="t0ken", interval=0.5, load=load,
                           transport=httpx.MockTransport(handler), **kwargs)  # type: ignore[arg-type]


def test_every_coordinator_gets_every_beat() -> None:
    got: list[tuple[str, str, Heartbeat]] = []

    def coordinators(request: httpx.Request) -> httpx.Response:
        got.append((request.url.host, request.headers["authorization"], Heartbeat(**json.loads(request.content))))
        return httpx.Response(200, json={})

    beats = sender(["http://c1:1337", "http://c2:1337/"], coordinators)
    assert asyncio.run(beats.send_once()) is True
    assert sorted(host for host, _, _ in got) == ["c1", "c2"]
    assert {auth for _, auth, _ in got} == {"Bearer t0ken"}
    assert {beat.worker_id for _, _, beat in got} == {"w1"}
    assert beats.sent == 2


def test_a_coordinator_that_is_down_holds_up_none_of_the_others(caplog: pytest.LogCaptureFixture) -> None:
    reached: list[str] = []

    def coordinators(request: httpx.Request) -> httpx.Response:
        if request.url.host == "down":
            raise httpx.ConnectError("refused", request=request)
        reached.append(request.url.host)
        return httpx.Response(200, json={})

    beats = sender(["http://down:1337", "http://up:1337"], coordinators)

    async def three() -> list[bool]:
        return [await beats.send_once() for _ in range(3)]

    with caplog.at_level(logging.INFO, logger="worker.heartbeat"):
        assert asyncio.run(three()) == [False, False, False]  # not every coordinator took it
    assert reached == ["up"] * 3 and beats.sent == 3
    # Logged once per change of each coordinator's state, not every interval.
    failed = [r for r in caplog.records if "heartbeat_failed" in r.getMessage()]
    assert len(failed) == 1 and "down" in failed[0].getMessage()
    assert sum("heartbeat_ok" in r.getMessage() for r in caplog.records) == 1


def test_resolve_all_beats_every_address_of_the_name_each_interval() -> None:
    hosts: list[str] = []
    answers = [["10.1.0.5", "10.1.0.7"], ["10.1.0.7", "fd00::3"]]  # a pod replaced between two beats

    async def resolver(host: str, port: int) -> list[str]:
        assert (host, port) == ("llm-coordinator-peers", 1337)
        return answers.pop(0)

    def coordinators(request: httpx.Request) -> httpx.Response:
        assert request.url.path == HEARTBEAT_PATH
        hosts.append(f"{request.url.host}:{request.url.port}")
        return httpx.Response(200, json={})

    beats = sender(["http://llm-coordinator-peers:1337"], coordinators, resolve_all=True, resolver=resolver)

    async def two() -> None:
        await beats.send_once()
        await beats.send_once()

    asyncio.run(two())
    assert sorted(hosts[:2]) == ["10.1.0.5:1337", "10.1.0.7:1337"]
    assert sorted(hosts[2:]) == ["10.1.0.7:1337", "fd00::3:1337"]


def test_a_name_that_does_not_resolve_is_a_failed_beat_not_a_crash() -> None:
    async def resolver(host: str, port: int) -> list[str]:
        raise OSError("Name or service not known")

    beats = sender(["http://nowhere:1337"], lambda request: httpx.Response(200), resolve_all=True,
                   resolver=resolver)
    assert asyncio.run(beats.send_once()) is False and beats.sent == 0


def test_settings_take_a_comma_separated_list_and_refuse_what_is_not_a_url() -> None:
    s = WorkerSettings(engine="simulated", coordinator_url=" http://c1:1337, http://c2:1337 ,")
    assert s.coordinator_urls == ("http://c1:1337", "http://c2:1337")
    assert WorkerSettings(engine="simulated", coordinator_url="").coordinator_urls == ()
    with pytest.raises(ValueError, match="not an http"):
        WorkerSettings(engine="simulated", coordinator_url="http://c1:1337,c2:1337")
    with pytest.raises(ValueError, match="at most"):
        WorkerSettings(engine="simulated",
                       coordinator_url=",".join(f"http://c{i}:1" for i in range(MAX_COORDINATORS + 1)))


def timed_sender(beats: list[float]) -> HeartbeatSender:
    """One coordinator, a 30 s interval; the loop time of each beat it receives goes into `beats`."""

    def coordinator(request: httpx.Request) -> httpx.Response:
        beats.append(asyncio.get_event_loop().time())
        return httpx.Response(200, json={})

    return HeartbeatSender(coordinator_urls=["http://c1:1337"], worker_id="w1", worker_url="http://w:1",
                           names=ModelNames("m", ()), token="", interval=30.0, load=load,
                           transport=httpx.MockTransport(coordinator))


def test_a_nudge_beats_at_once_instead_of_at_the_next_interval() -> None:
    beats: list[float] = []
    beats_sender = timed_sender(beats)

    async def nudged() -> None:
        task = asyncio.create_task(beats_sender.run())
        while not beats:
            await asyncio.sleep(0.01)
        beats_sender.nudge()  # a new named session
        beats_sender.nudge()  # and another at once: one beat for both
        await asyncio.sleep(0.5)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    asyncio.run(nudged())
    assert len(beats) == 2 and beats[1] - beats[0] < 1.0  # not after the 30 s interval


def test_a_room_nudge_beats_without_the_nudge_gap_but_no_sooner_than_the_room_gap_after_the_last(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A freed sequence of a full worker (several coordinators): announced at once, so that another
    coordinator's queue can race for it; ROOM_GAP bounds how often that can make it beat."""
    monkeypatch.setattr("worker.heartbeat.NUDGE_GAP", 1.0)  # so that "without it" shows plainly
    beats: list[float] = []
    nudged: list[float] = []
    beats_sender = timed_sender(beats)

    async def run() -> None:
        loop = asyncio.get_running_loop()
        task = asyncio.create_task(beats_sender.run())
        while not beats:
            await asyncio.sleep(0.005)
        beats_sender.nudge(room=True)  # at once after a beat: held back to ROOM_GAP after it
        while len(beats) < 2:
            await asyncio.sleep(0.005)
        await asyncio.sleep(ROOM_GAP + 0.05)
        nudged.append(loop.time())
        beats_sender.nudge(room=True)  # long after the last beat: at once
        while len(beats) < 3:
            await asyncio.sleep(0.005)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    asyncio.run(asyncio.wait_for(run(), 10))
    assert beats[1] - beats[0] >= ROOM_GAP * 0.9
    assert beats[2] - nudged[0] < 0.5  # not held back the way a new session's nudge is (1 s here)


def test_a_coordinator_not_reached_is_beaten_to_again_within_reach_retry_and_the_others_get_no_extra_beats(
        ) -> None:
    """A restarted coordinator joins its shared port only once it knows the pool: every worker's beat
    must reach it within REACH_RETRY, not at the next interval (30 s here)."""
    got: dict[str, list[float]] = {"up": [], "late": []}
    opened_at: list[float] = []

    def coordinators(request: httpx.Request) -> httpx.Response:
        now = asyncio.get_event_loop().time()
        if request.url.host == "late" and not opened_at:
            raise httpx.ConnectError("refused", request=request)
        got[request.url.host].append(now)
        return httpx.Response(200, json={})

    beats = HeartbeatSender(coordinator_urls=["http://up:1337", "http://late:1337"], worker_id="w1",
                            worker_url="http://w:1", names=ModelNames("m", ()), token="", interval=30.0,
                            load=load, transport=httpx.MockTransport(coordinators))

    async def run() -> None:
        loop = asyncio.get_running_loop()
        task = asyncio.create_task(beats.run())
        await asyncio.sleep(REACH_RETRY * 2.5)  # down all this while: retried, and refused again
        opened_at.append(loop.time())
        while not got["late"]:
            await asyncio.sleep(0.01)
        await asyncio.sleep(REACH_RETRY * 2.5)  # reached: no more beats until the interval
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    asyncio.run(asyncio.wait_for(run(), 10))
    assert len(got["up"]) == 1  # the first beat only: the retries go to the one not reached
    assert len(got["late"]) == 1 and got["late"][0] - opened_at[0] <= REACH_RETRY + 0.2


ACK = {"worker_id": "w1", "state": "alive", "heartbeat_interval": 0.5}


def test_each_beat_passes_on_the_most_workers_a_coordinator_counted_in_its_last_answer() -> None:
    counts = {"c1": 3, "c2": 1}
    seen: list[int] = []

    def coordinators(request: httpx.Request) -> httpx.Response:
        seen.append(Heartbeat(**json.loads(request.content)).pool_workers)
        if request.url.host == "c3":
            return httpx.Response(200, json={**ACK, "workers": "many"})  # not a count: counts as none
        return httpx.Response(200, json={**ACK, "workers": counts[request.url.host]})

    beats = sender(["http://c1:1337", "http://c2:1337", "http://c3:1337"], coordinators)

    async def three() -> None:
        await beats.send_once()
        await beats.send_once()
        counts["c1"] = 2  # a worker of the pool gone
        await beats.send_once()
        await beats.send_once()

    asyncio.run(three())
    assert seen == [0] * 3 + [3] * 3 + [3] * 3 + [2] * 3


def test_only_the_last_beat_says_leaving() -> None:
    seen: list[bool] = []

    def coordinators(request: httpx.Request) -> httpx.Response:
        seen.append(Heartbeat(**json.loads(request.content)).leaving)
        return httpx.Response(200, json=ACK)

    beats = sender(["http://c1:1337", "http://c2:1337"], coordinators)

    async def stop() -> None:
        await beats.send_once()
        await beats.send_once(leaving=True)

    asyncio.run(stop())
    assert seen == [False, False, True, True]


def test_each_beat_passes_on_the_tenants_every_coordinator_said_wait() -> None:
    waiting = {"c1": ["t:light"], "c2": ["t:heavy", "t:light"]}
    seen: list[list[str]] = []

    def coordinators(request: httpx.Request) -> httpx.Response:
        if request.url.host == "c1":
            seen.append(Heartbeat(**json.loads(request.content)).load.waiting)
        return httpx.Response(200, json={**ACK, "waiting": waiting[request.url.host]})

    beats = sender(["http://c1:1337", "http://c2:1337"], coordinators)

    async def three() -> None:
        await beats.send_once()
        await beats.send_once()
        waiting["c2"] = []  # c2's queue emptied
        await beats.send_once()
        await beats.send_once()

    asyncio.run(three())
    assert seen == [[], ["t:heavy", "t:light"], ["t:heavy", "t:light"], ["t:light"]]
