"""A tenant is the API key: session ids, conversation affinity and cached answers belong to the key
that made them (coordinator/auth.py, sessions.py, conversations.py, cache.py)."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from urllib.parse import parse_qs

import httpx
import pytest

from coordinator.auth import own_tenant
from coordinator.clock import ManualClock
from coordinator.settings import Settings
from tests.coordinator import fakes

pytestmark = pytest.mark.anyio
KEYS = {"A": "key-of-alpha", "B": "key-of-beta"}
SETTINGS = Settings(heartbeat_interval=1.0, queue_size=0, api_keys=",".join(KEYS.values()), cache_entries=100)


@dataclass
class TenantWorker:
    """A fake worker that keeps sessions by (tenant, id), as a real one does, and notes every call."""

    sessions: set[tuple[str, str]] = field(default_factory=set)
    generated: list[dict[str, object]] = field(default_factory=list)
    expected: list[bool] = field(default_factory=list)  # X-Session-Expected of each generation

    def behaviour(self, request: httpx.Request) -> httpx.Response:
        if request.method == "DELETE":
            key = (parse_qs(request.url.query.decode()).get("tenant", [""])[0], request.url.path.rsplit("/", 1)[1])
            if key not in self.sessions:
                return httpx.Response(404, json={"error": "no", "reason": "unknown_session", "request_id": "x"})
            self.sessions.discard(key)
            return httpx.Response(204)
        body = json.loads(request.content)
        self.generated.append(body)
        self.expected.append(request.headers.get("x-session-expected") == "1")
        if body.get("session_id"):
            self.sessions.add((body.get("tenant", ""), body["session_id"]))
        return fakes.streaming([fakes.token(0, "ok"), fakes.done()])(request)


def as_(who: str) -> dict[str, str]:
    return {"authorization": f"Bearer {KEYS[who]}"}


async def test_another_keys_session_id_is_unknown_to_it_for_every_operation() -> None:
    clock, worker = ManualClock(), TenantWorker()
    async with fakes.running_app(SETTINGS, fakes.FakeWorkers({"w1": worker.behaviour}), clock) as client:
        await fakes.register(client, fakes.heartbeat("w1", timestamp=clock.time()))
        turn = {"prompt": "My secret number is 4242", "max_tokens": 3, "session_id": "s1"}
        assert fakes.events_of((await client.post("/coordinator/infer", json=turn, headers=as_("A"))).text)[-1][0] == "done"
        assert worker.generated[-1]["tenant"] == own_tenant(KEYS["A"])
        # B ending A's session: 404, and the worker is not asked.
        refused = await client.delete("/coordinator/sessions/s1", headers=as_("B"))
        assert (refused.status_code, refused.json()["reason"]) == (404, "unknown_session")
        assert worker.sessions == {(own_tenant(KEYS["A"]), "s1")}
        # B "continuing" s1 starts B's own conversation: not expected to exist, and under B's tenant.
        await client.post("/coordinator/infer", json={**turn, "prompt": "What was my number?"}, headers=as_("B"))
        assert worker.generated[-1]["tenant"] == own_tenant(KEYS["B"]) and worker.expected[-1] is False
        # A's next turn still continues A's own.
        await client.post("/coordinator/infer", json=turn, headers=as_("A"))
        assert worker.generated[-1]["tenant"] == own_tenant(KEYS["A"]) and worker.expected[-1] is True
        # Each ends its own, and only its own.
        assert (await client.delete("/coordinator/sessions/s1", headers=as_("A"))).status_code == 204
        assert worker.sessions == {(own_tenant(KEYS["B"]), "s1")}
        assert (await client.delete("/coordinator/sessions/s1", headers=as_("A"))).status_code == 404
        assert (await client.delete("/coordinator/sessions/s1", headers=as_("B"))).status_code == 204
        assert (await client.delete("/coordinator/sessions/s1")).status_code == 401


async def test_a_cached_answer_is_never_served_to_another_key() -> None:
    clock, worker = ManualClock(), TenantWorker()
    async with fakes.running_app(SETTINGS, fakes.FakeWorkers({"w1": worker.behaviour}), clock) as client:
        await fakes.register(client, fakes.heartbeat("w1", timestamp=clock.time()))
        body = {"prompt": "My PIN is 0000", "max_tokens": 3, "temperature": 0}
        cached = []
        for who in ("A", "B", "A", "B"):
            stream = await client.post("/coordinator/infer", json=body, headers=as_(who))
            cached.append(fakes.events_of(stream.text)[-1][1].get("cached", False))
        assert cached == [False, False, True, True]  # each key's own repeat hits its own entry
        assert len(worker.generated) == 2


async def test_conversation_affinity_is_per_key() -> None:
    """Two workers; A's conversation went to w1. B resending the same conversation gets no preference
    for w1 (it is routed by load, like any first turn), while A's next turn does."""
    clock = ManualClock()
    w1, w2 = TenantWorker(), TenantWorker()
    async with fakes.running_app(SETTINGS, fakes.FakeWorkers({"w1": w1.behaviour, "w2": w2.behaviour}), clock) as client:
        await fakes.register(client, fakes.heartbeat("w1", timestamp=clock.time()))
        await fakes.register(client, fakes.heartbeat("w2", timestamp=clock.time()))
        first = [{"role": "user", "content": "Remember 4242"}]
        chat = {"model": "smol", "max_tokens": 3, "messages": first}
        served = (await client.post("/v1/chat/completions", json=chat, headers=as_("A"))).headers["x-worker-id"]
        other = "w2" if served == "w1" else "w1"
        # Make the serving worker the busier one: only affinity sends a next turn back to it.
        await fakes.register(client, fakes.heartbeat(served, timestamp=clock.time(), sessions=3, active_streams=3))
        nxt = {**chat, "messages": [*first, {"role": "assistant", "content": "ok"}, {"role": "user", "content": "?"}]}
        assert (await client.post("/v1/chat/completions", json=nxt, headers=as_("B"))).headers["x-worker-id"] == other
        assert (await client.post("/v1/chat/completions", json=nxt, headers=as_("A"))).headers["x-worker-id"] == served


async def test_random_operations_of_two_keys_never_touch_the_others_sessions() -> None:
    """An invariant over a seeded random sequence of (key, session id, operation): every turn reaches
    the worker under its own key's tenant and continues a session only when that key has it; every
    delete succeeds exactly when that key has the session."""
    rng = random.Random(22)
    clock, worker = ManualClock(), TenantWorker()
    have: set[tuple[str, str]] = set()  # the model: (who, session id) that exist
    shared = 0
    async with fakes.running_app(SETTINGS, fakes.FakeWorkers({"w1": worker.behaviour}), clock) as client:
        await fakes.register(client, fakes.heartbeat("w1", timestamp=clock.time(), max_sessions=64))
        for _ in range(300):
            # The worker's report, as its heartbeats would say it (the view would otherwise keep every
            # ended stream's kept session until a report).
            clock.advance(1.0)
            await fakes.register(client, fakes.heartbeat("w1", timestamp=clock.time(), max_sessions=64,
                                             sessions=len(worker.sessions)))
            who, sid, op = rng.choice("AB"), rng.choice(["s1", "s2", "s3"]), rng.choice(["turn", "turn", "delete"])
            if op == "turn":
                response = await client.post("/coordinator/infer", headers=as_(who),
                                             json={"prompt": f"{who} says hi", "max_tokens": 2, "session_id": sid})
                assert response.status_code == 200, response.text
                assert worker.generated[-1]["tenant"] == own_tenant(KEYS[who])
                assert worker.expected[-1] == ((who, sid) in have)
                have.add((who, sid))
            else:
                response = await client.delete(f"/coordinator/sessions/{sid}", headers=as_(who))
                assert response.status_code == (204 if (who, sid) in have else 404)
                have.discard((who, sid))
            assert worker.sessions == {(own_tenant(KEYS[w]), s) for w, s in have}
            shared += any(("A", s) in have and ("B", s) in have for s in ("s1", "s2", "s3"))
        assert shared > 50  # both keys held a session of the same id, often
