"""Browsers calling the pool: preflights of allowed origins answered (before the API keys, which a
preflight cannot carry), CORS headers on their answers, streams included; nothing for anyone else."""

from __future__ import annotations

import pytest

from coordinator.clock import ManualClock
from coordinator.settings import Settings
from tests.coordinator.fakes import FakeWorkers, done, heartbeat, register, running_app, streaming, token

pytestmark = pytest.mark.anyio
APP = "https://app.example"
PREFLIGHT = {"access-control-request-method": "POST", "access-control-request-headers": "authorization"}


async def test_an_allowed_origin_gets_its_preflight_and_headers_another_gets_none() -> None:
    clock, fakes = ManualClock(), FakeWorkers({"w1": streaming([token(0, "Hi"), done()])})
    settings = Settings(heartbeat_interval=1.0, cors_origins=f"{APP}, https://other.example", api_keys="k1")
    async with running_app(settings, fakes, clock) as client:
        await register(client, heartbeat("w1", timestamp=clock.time()))
        allowed = await client.options("/v1/chat/completions", headers={"origin": APP, **PREFLIGHT})
        assert allowed.status_code == 200  # no key: a preflight never carries one
        assert allowed.headers["access-control-allow-origin"] == APP
        assert "POST" in allowed.headers["access-control-allow-methods"]
        assert "authorization" in allowed.headers["access-control-allow-headers"]
        stranger = await client.options("/v1/chat/completions",
                                        headers={"origin": "https://evil.example", **PREFLIGHT})
        assert "access-control-allow-origin" not in stranger.headers
        streamed = await client.post("/v1/chat/completions", headers={"origin": APP, "authorization": "Bearer k1"},
                                     json={"messages": [{"role": "user", "content": "x"}], "stream": True})
        assert streamed.status_code == 200 and "data: [DONE]" in streamed.text
        assert streamed.headers["access-control-allow-origin"] == APP
        assert "x-request-id" in streamed.headers["access-control-expose-headers"]
        keyless = await client.post("/v1/chat/completions", headers={"origin": APP},
                                    json={"messages": [{"role": "user", "content": "x"}]})
        assert keyless.status_code == 401 and keyless.headers["access-control-allow-origin"] == APP
        plain = await client.get("/v1/models", headers={"authorization": "Bearer k1"})
        assert "access-control-allow-origin" not in plain.headers


async def test_without_origins_configured_no_preflight_is_answered() -> None:
    clock = ManualClock()
    async with running_app(Settings(heartbeat_interval=1.0), FakeWorkers(), clock) as client:
        response = await client.options("/v1/chat/completions", headers={"origin": APP, **PREFLIGHT})
        assert response.status_code == 405 and "access-control-allow-origin" not in response.headers


async def test_health_answers_at_the_path_probes_use() -> None:
    clock = ManualClock()
    async with running_app(Settings(heartbeat_interval=1.0, api_keys="k1"), FakeWorkers(), clock) as client:
        await register(client, heartbeat("w1", timestamp=clock.time()))
        both = [await client.get(path) for path in ("/health", "/coordinator/health")]
    assert [r.status_code for r in both] == [200, 200]
    assert both[0].json()["workers"] == both[1].json()["workers"] == {"alive": 1, "stale": 0, "total": 1}
