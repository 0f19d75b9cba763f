"""Heartbeats from someone who is not the worker: forged ids, impossible claims, loose types
(issue 11's findings, each refused here before the fix was not)."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from coordinator.clock import ManualClock
from coordinator.settings import Settings
from tests.coordinator.fakes import FakeWorkers, done, heartbeat, register, running_app, streaming, token

pytestmark = pytest.mark.anyio
OPEN = Settings(heartbeat_interval=1.0, queue_size=0)  # no worker token, as ./start.sh used to run
STREAM = [token(0, "hi"), done()]


async def post_raw(client: httpx.AsyncClient, body: dict[str, Any], token_: str | None = None) -> httpx.Response:
    headers = {"authorization": f"Bearer {token_}"} if token_ else {}
    return await client.post("/coordinator/health/heartbeat", content=json.dumps(body), headers=headers)


def beat_dict(clock: ManualClock, **load: Any) -> dict[str, Any]:
    return json.loads(heartbeat("w1", timestamp=clock.time(), **load).model_dump_json())


async def test_without_a_token_a_live_workers_id_cannot_be_claimed_from_another_url() -> None:
    clock, fakes = ManualClock(), FakeWorkers({"w1": streaming(STREAM)}, ids={"w1b": "w1", "evil": "w1"})
    async with running_app(OPEN, fakes, clock) as client:
        assert (await register(client, heartbeat("w1", timestamp=clock.time()))).status_code == 200
        forged = await register(client, heartbeat("w1", timestamp=clock.time(), url="http://evil.test"))
        assert forged.status_code == 409 and forged.json()["reason"] == "worker_conflict"
        listing = (await client.get("/coordinator/health/workers")).json()["workers"]
        assert [w["url"] for w in listing] == ["http://w1.test"]
        # Once the real registration is no longer alive, the id may move (a restarted worker elsewhere).
        clock.advance(OPEN.stale_after + 0.1)
        moved = await register(client, heartbeat("w1", timestamp=clock.time(), url="http://w1b.test"))
        assert moved.status_code == 200


async def test_a_leaving_beat_takes_its_worker_out_at_once_and_registers_nothing() -> None:
    """A worker's last beat, as it stops after its drain: before, it stayed `alive` until its beats were
    missed, and requests and session turns went to a closed port meanwhile."""
    clock = ManualClock()
    fakes = FakeWorkers({"w1": streaming(STREAM), "w2": streaming(STREAM, worker_id="w2")})
    async with running_app(OPEN, fakes, clock) as client:
        for worker_id in ("w1", "w2"):
            assert (await register(client, heartbeat(worker_id, timestamp=clock.time()))).status_code == 200

        async def states() -> dict[str, str]:
            listing = (await client.get("/coordinator/health/workers")).json()["workers"]
            return {w["worker_id"]: w["state"] for w in listing}

        def leaving(worker_id: str, **over: Any) -> Any:
            return heartbeat(worker_id, timestamp=clock.time(), **over).model_copy(update={"leaving": True})

        # Not from where that id is registered: whoever beats from there is not leaving.
        assert (await register(client, leaving("w1", url="http://evil.test"))).status_code == 200
        assert await states() == {"w1": "alive", "w2": "alive"}
        left = await register(client, leaving("w1"))
        assert left.status_code == 200 and left.json()["state"] == "stale"
        assert await states() == {"w1": "stale", "w2": "alive"}
        before = len(fakes.calls)
        answer = await client.post("/coordinator/infer", content=json.dumps({"prompt": "hi", "max_tokens": 2}))
        assert answer.status_code == 200 and fakes.hosts_called()[before:] == ["w2"]
        assert (await register(client, leaving("w3"))).status_code == 200  # unknown: nothing registered
        assert "w3" not in await states() and "w3" not in fakes.probes
        assert 'coordinator_heartbeats_total{outcome="leaving"} 3.0' in (await client.get("/metrics")).text


async def test_with_the_token_a_worker_may_move() -> None:
    clock, fakes = ManualClock(), FakeWorkers({"w1": streaming(STREAM)}, ids={"w1b": "w1"})
    settings = Settings(heartbeat_interval=1.0, queue_size=0, worker_token="s3cret")
    async with running_app(settings, fakes, clock) as client:
        assert (await register(client, heartbeat("w1", timestamp=clock.time()), "s3cret")).status_code == 200
        moved = await register(client, heartbeat("w1", timestamp=clock.time(), url="http://w1b.test"), "s3cret")
        assert moved.status_code == 200
        listing = (await client.get("/coordinator/health/workers")).json()["workers"]
        assert [w["url"] for w in listing] == ["http://w1b.test"]


async def test_a_new_worker_is_registered_only_once_its_url_answers_as_that_worker() -> None:
    """Before: a heartbeat alone registered a worker, so fakes that heartbeat but never answer were
    ranked with the real ones and cost clients failovers and 502s until their breakers opened."""
    clock = ManualClock()
    fakes = FakeWorkers({"real": streaming(STREAM, worker_id="real")}, silent={"liar"}, ids={"other": "w9"})
    settings = Settings(heartbeat_interval=1.0, queue_size=0, worker_token="s3cret", worker_probe_timeout=0.5)
    async with running_app(settings, fakes, clock) as client:
        for worker_id, url in [("liar", None), ("w7", "http://other.test")]:
            refused = await register(client, heartbeat(worker_id, timestamp=clock.time(), url=url), "s3cret")
            assert refused.status_code == 502 and refused.json()["reason"] == "worker_unavailable"
            assert "not registered" in refused.json()["error"]
        assert (await register(client, heartbeat("real", timestamp=clock.time()), "s3cret")).status_code == 200
        listing = (await client.get("/coordinator/health/workers")).json()["workers"]
        assert [w["worker_id"] for w in listing] == ["real"]
        for _ in range(3):  # later heartbeats of a registered worker are not probed again
            assert (await register(client, heartbeat("real", timestamp=clock.time()), "s3cret")).status_code == 200
        assert fakes.probes == ["other", "real"]
        for _ in range(6):
            response = await client.post("/coordinator/infer", content=json.dumps({"prompt": "hi", "max_tokens": 2}))
            assert response.status_code == 200 and response.headers["x-worker-id"] == "real"
        assert [host for host, _ in fakes.calls] == ["real"] * 6
        text = (await client.get("/metrics")).text
        assert 'coordinator_heartbeats_total{outcome="unproven"} 2.0' in text


@pytest.mark.parametrize("change", [
    {"load": {"sessions": 9, "max_sessions": 4}},  # more sessions than slots
    {"load": {"kv_capacity_bytes": int("9" * 400)}},  # a 400-digit number
    {"load": {"kv_capacity_bytes": 10 ** 20}},  # past any device
    {"worker_id": "w1\nforged log line"},
    {"worker_id": "w1 two"},
    {"url": "http://w1.test/\nx"},
    {"url": "ftp://w1.test"},
    {"load": {"sessions": "1"}},  # strings are not numbers
    {"load": {"sessions": True}},  # nor are booleans
    # Capacity claims past what llama.cpp and the context allow (before: 100,000 sessions were accepted).
    {"load": {"max_sessions": 100_000}},  # llama.cpp holds at most 256 sequences in a context
    {"load": {"max_sessions": 257}},
    {"load": {"session_max_tokens": 20_000}},  # one session larger than the whole context (1,000,000 B)
])
async def test_impossible_or_loosely_typed_heartbeats_are_400(change: dict[str, Any]) -> None:
    clock, fakes = ManualClock(), FakeWorkers({})
    async with running_app(OPEN, fakes, clock) as client:
        body = beat_dict(clock)
        for key, value in change.items():
            if key == "load":
                body["load"].update(value)
            else:
                body[key] = value
        response = await post_raw(client, body)
        assert response.status_code == 400, response.text
        assert (await client.get("/coordinator/health/workers")).json()["workers"] == []


async def test_a_huge_capacity_claim_is_clamped_to_what_its_sessions_could_use() -> None:
    """Before: a fake worker claiming a huge capacity made admission answer kv_full for everyone
    while health said ok (the sums were dominated by it); now its capacity counts as at most
    max_sessions x session_max_tokens x bytes_per_token."""
    clock, fakes = ManualClock(), FakeWorkers({})
    async with running_app(OPEN, fakes, clock) as client:
        body = beat_dict(clock, kv_capacity_bytes=10 ** 14)
        assert (await post_raw(client, body)).status_code == 200
        seen = (await client.get("/coordinator/health/workers")).json()["workers"][0]
        assert seen["kv_capacity_bytes"] == 4 * 2_000 * 100


async def test_a_url_pattern_restricts_where_workers_may_be() -> None:
    clock, fakes = ManualClock(), FakeWorkers({})
    settings = Settings(heartbeat_interval=1.0, queue_size=0, worker_url_pattern=r"http://w\d\.test")
    async with running_app(settings, fakes, clock) as client:
        assert (await register(client, heartbeat("w1", timestamp=clock.time()))).status_code == 200
        elsewhere = await register(client, heartbeat("w2", timestamp=clock.time(), url="http://other.test"))
        assert elsewhere.status_code == 400


async def test_idle_kept_sessions_do_not_make_a_full_worker_refuse_new_requests() -> None:
    """Before: once kept sessions filled every slot, the coordinator answered sessions_full until
    their TTL, although the worker evicts an idle session to admit a new one."""
    clock, fakes = ManualClock(), FakeWorkers({"w1": streaming(STREAM)})
    async with running_app(OPEN, fakes, clock) as client:
        full_of_idle = heartbeat("w1", timestamp=clock.time(), sessions=4, idle_sessions=4,
                                 kv_reserved_bytes=800_000, kv_used_bytes=800_000, idle_kv_bytes=800_000)
        assert (await register(client, full_of_idle)).status_code == 200
        served = await client.post("/coordinator/infer", json={"prompt": "hi", "max_tokens": 5})
        assert served.status_code == 200
        busy = heartbeat("w1", timestamp=clock.time(), sessions=4, idle_sessions=0)
        assert (await register(client, busy)).status_code == 200
        refused = await client.post("/coordinator/infer", json={"prompt": "hi", "max_tokens": 5})
        assert refused.status_code == 503 and refused.json()["reason"] == "sessions_full"


def test_the_largest_heartbeat_the_protocol_allows_fits_the_coordinators_body_limit() -> None:
    """Every list in a heartbeat has a ceiling: all of them full (the sessions and streams a context can
    hold, the prefix blocks and tenants listed, the longest names) still fit HEARTBEAT_MAX_BYTES."""
    from coordinator.app import HEARTBEAT_MAX_BYTES
    from protocol.health import (
        MAX_BYTES,
        MAX_HEARTBEAT_TENANTS,
        MAX_HELD_PREFIX_BLOCKS,
        MAX_OFFER_REASON,
        MAX_OFFERED,
        MAX_SESSIONS,
        Heartbeat,
        OfferedModel,
        TenantUse,
    )
    from protocol.worker import MAX_STREAM_REF

    name = "m" * 128  # MODEL_NAME_PATTERN: at most 128 characters
    load = heartbeat("w" * 128, timestamp=1.0, sessions=MAX_SESSIONS, max_sessions=MAX_SESSIONS,
                     streams=[MAX_STREAM_REF - i for i in range(MAX_SESSIONS)],
                     held=[f"{i:016x}" for i in range(MAX_SESSIONS)],
                     prefixes=[f"{i:016x}" for i in range(MAX_HELD_PREFIX_BLOCKS)],
                     tenants=[TenantUse(tenant=f"t:{i:062d}", running=MAX_SESSIONS // MAX_HEARTBEAT_TENANTS, prompt_tokens=1 << 62,
                                        generated_tokens=1 << 62) for i in range(MAX_HEARTBEAT_TENANTS)]).load
    offer = OfferedModel(name=name, aliases=[name] * 4, identity="gguf:" + "0" * 123, state="too_large",
                         need_bytes=MAX_BYTES, reason="r" * MAX_OFFER_REASON)
    beat = Heartbeat(worker_id="w" * 128, url="http://" + "h" * 480 + ":3001", model=name, aliases=[name] * 16,
                     model_identity="gguf:" + "0" * 64, load=load, timestamp=1.0, offered=[offer] * MAX_OFFERED,
                     swapping=name, standby=True)
    size = len(beat.model_dump_json().encode())
    assert size <= HEARTBEAT_MAX_BYTES, size
