"""Client API keys (coordinator/auth.py) and where the app asks for them."""

from __future__ import annotations

from pathlib import Path

import pytest

from coordinator.auth import ApiKeys, Client, key_id, own_tenant
from coordinator.clock import ManualClock
from coordinator.settings import Settings
from tests.coordinator.fakes import FakeWorkers, done, heartbeat, register, running_app, streaming, token

pytestmark = pytest.mark.anyio
KEYS = "alpha-key-1,beta-key-2"


def test_keys_come_from_a_list_or_a_file(tmp_path: Path) -> None:
    listed = ApiKeys.from_setting(KEYS)
    assert listed is not None and len(listed) == 2
    path = tmp_path / "keys"
    path.write_text("# clients\nalpha-key-1\n\nbeta-key-2\n")
    filed = ApiKeys.from_setting(str(path))
    assert filed is not None and len(filed) == 2
    assert ApiKeys.from_setting(None) is None and ApiKeys.from_setting("") is None


ALPHA = Client(key_id("alpha-key-1"), own_tenant("alpha-key-1"))
BETA = Client(key_id("beta-key-2"), own_tenant("beta-key-2"))


@pytest.mark.parametrize(("headers", "found"), [
    ({"authorization": "Bearer alpha-key-1"}, ALPHA),
    ({"authorization": "bearer beta-key-2"}, BETA),
    ({"x-api-key": "beta-key-2"}, BETA),
    ({"authorization": "Bearer alpha-key"}, None),  # a prefix of a key is no key
    ({"authorization": "alpha-key-1"}, None),
    ({"authorization": "Bearer "}, None),
    ({}, None),
])
def test_identify(headers: dict[str, str], found: Client | None) -> None:
    keys = ApiKeys.from_setting(KEYS)
    assert keys is not None and keys.identify(headers) == found


def test_each_key_is_its_own_tenant_unless_its_entry_names_one(tmp_path: Path) -> None:
    path = tmp_path / "keys"
    path.write_text("alpha-key-1 acme\nbeta-key-2 acme\ngamma-key-3\n")
    keys = ApiKeys.from_setting(str(path))
    assert keys is not None
    tenants = [keys.identify({"x-api-key": k}) for k in ("alpha-key-1", "beta-key-2", "gamma-key-3")]
    assert [c.tenant for c in tenants if c] == ["t:acme", "t:acme", own_tenant("gamma-key-3")]
    assert len({c.key_id for c in tenants if c}) == 3  # metrics still tell the keys apart
    assert own_tenant("alpha-key-1") != own_tenant("beta-key-2")


@pytest.mark.parametrize("entry", ["key a 1 b", "key bad/name", "key " + "x" * 49])
def test_a_malformed_entry_is_refused_at_start(entry: str) -> None:
    with pytest.raises(ValueError, match="KEY TENANT"):
        ApiKeys([entry])


def test_a_tenants_weight_comes_from_its_entries(tmp_path: Path) -> None:
    path = tmp_path / "keys"
    path.write_text("# heavy and light\nheavy-key heavy 1\nlight-key light 3\nlight-key-2 light 3\nplain-key\n")
    keys = ApiKeys.from_setting(str(path))
    assert keys is not None and keys.weights == {"t:heavy": 1.0, "t:light": 3.0}


@pytest.mark.parametrize("weight", ["0", "-1", "nan", "inf", "heavy", "1e7"])
def test_a_weight_of_0_or_below_or_not_a_number_is_refused_naming_its_line(tmp_path: Path, weight: str) -> None:
    path = tmp_path / "keys"
    path.write_text(f"# keys\ngood-key good 2\n\nbad-key bad {weight}\n")
    with pytest.raises(ValueError, match=r"keys line 4: the weight"):
        ApiKeys.from_setting(str(path))


def test_two_weights_for_one_tenant_are_refused() -> None:
    with pytest.raises(ValueError, match="entry 2: tenant 'acme' was given weight 1 .* and 2 here"):
        ApiKeys(["a-key acme 1", "b-key acme 2"])


async def test_generation_surfaces_need_a_key_and_health_does_not(caplog: pytest.LogCaptureFixture) -> None:
    clock = ManualClock()
    fakes = FakeWorkers({"w1": streaming([token(0, "hi"), done()])})
    settings = Settings(heartbeat_interval=1.0, queue_size=0, api_keys=KEYS)
    async with running_app(settings, fakes, clock) as client:
        assert (await register(client, heartbeat("w1", timestamp=clock.time()))).status_code == 200
        body = {"prompt": "hi", "max_tokens": 3}
        for headers in ({}, {"authorization": "Bearer wrong"}, {"x-api-key": "alpha"}):
            refused = await client.post("/coordinator/infer", json=body, headers=headers)
            assert refused.status_code == 401 and refused.json()["reason"] == "unauthorized"
            assert refused.headers["www-authenticate"] == "Bearer"
        models = await client.get("/v1/models")
        assert models.status_code == 401 and models.json()["error"]["code"] == "unauthorized"
        chat = await client.post("/v1/chat/completions", json={"model": "smol", "messages": []})
        assert chat.status_code == 401
        assert fakes.calls == []  # nothing refused reached a worker
        served = await client.post("/coordinator/infer", json=body, headers={"authorization": "Bearer alpha-key-1"})
        assert served.status_code == 200
        served = await client.post("/coordinator/infer", json=body, headers={"x-api-key": "beta-key-2"})
        assert served.status_code == 200
        assert (await client.get("/v1/models", headers={"x-api-key": "beta-key-2"})).status_code == 200
        assert (await client.get("/coordinator/health")).status_code == 200
        assert (await client.get("/metrics")).status_code == 401  # with keys, by default
        metrics = (await client.get("/metrics", headers={"x-api-key": "beta-key-2"})).text
        assert f'coordinator_requests_by_key_total{{key_id="{key_id("alpha-key-1")}"}} 1.0' in metrics
        assert "coordinator_unauthorized_requests_total 6.0" in metrics
        assert "alpha-key-1" not in metrics and "beta-key-2" not in metrics
    assert "alpha-key-1" not in caplog.text and "beta-key-2" not in caplog.text


async def test_with_keys_metrics_need_one_unless_opened_on_purpose() -> None:
    async with running_app(Settings(heartbeat_interval=1.0, api_keys=KEYS), FakeWorkers({}), ManualClock()) as client:
        assert (await client.get("/metrics")).status_code == 401
        assert (await client.get("/metrics", headers={"x-api-key": "alpha-key-1"})).status_code == 200
        assert (await client.get("/coordinator/health")).status_code == 200
    opened = Settings(heartbeat_interval=1.0, api_keys=KEYS, open_metrics=True)  # a scraper that sends none
    async with running_app(opened, FakeWorkers({}), ManualClock()) as client:
        assert (await client.get("/metrics")).status_code == 200
        assert (await client.get("/coordinator/status")).status_code == 200
        assert (await client.post("/coordinator/infer", json={"prompt": "x"})).status_code == 401


async def test_the_status_snapshot_is_protected_with_the_metrics() -> None:
    settings = Settings(heartbeat_interval=1.0, api_keys=KEYS)
    async with running_app(settings, FakeWorkers({}), ManualClock()) as client:
        assert (await client.get("/coordinator/status")).status_code == 401
        assert (await client.get("/coordinator/status", headers={"x-api-key": "alpha-key-1"})).status_code == 200
        assert (await client.get("/status")).status_code == 200  # the page: no data in it
