"""The status page and the snapshot it polls, in-process (the real-browser test is
tests/integration/test_status_page.py): the page is self-contained and inserts nothing as markup,
its CSP admits exactly its own script, it keeps an API key in the tab and sends it as a header, it
stays open when the snapshot needs a key, and the snapshot's counters agree with /metrics."""

from __future__ import annotations

import base64
import hashlib
import json
import re

import pytest

from coordinator.clock import ManualClock
from coordinator.ops.status_page import PAGE_FILE
from coordinator.settings import Settings
from tests.coordinator.fakes import FakeWorkers, done, heartbeat, register, running_app, streaming, token

pytestmark = pytest.mark.anyio

SETTINGS = Settings(heartbeat_interval=1.0, retry_after=3, queue_size=0)
STREAM = [token(0, "He"), token(1, "llo"), token(2, "!"), done()]
PAGE = PAGE_FILE.read_text(encoding="utf-8")
SCRIPT = re.search(r"<script>(.*?)</script>", PAGE, flags=re.DOTALL).group(1)  # type: ignore[union-attr]


async def test_the_page_is_served_with_a_csp_that_admits_only_its_own_script() -> None:
    async with running_app(SETTINGS, FakeWorkers(), ManualClock()) as client:
        response = await client.get("/status")
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/html")
        assert response.text == PAGE
        csp = dict(part.strip().split(" ", 1) for part in response.headers["content-security-policy"].split(";"))
        digest = base64.b64encode(hashlib.sha256(SCRIPT.encode()).digest()).decode()
        assert csp["script-src"] == f"'sha256-{digest}'"  # not 'unsafe-inline': an injected handler cannot run
        assert csp["default-src"] == "'none'" and csp["connect-src"] == "'self'"
        redirect = await client.get("/", follow_redirects=False)
        assert redirect.status_code == 307 and redirect.headers["location"] == "status"
        assert (await client.get("/", follow_redirects=True)).text == PAGE


def test_the_page_is_one_file_without_external_assets() -> None:
    assert PAGE.count("<script") == 1 and "<link" not in PAGE and "@import" not in PAGE
    assert re.search(r"\b(src|href)\s*=", PAGE) is None, "no element loads anything"
    addresses = set(re.findall(r"https?://[^\s\"')]+", PAGE))
    assert addresses <= {"http://www.w3.org/2000/svg"}, addresses  # the SVG namespace is a name, not a fetch
    assert re.findall(r"fetch\(([^,)]*)", SCRIPT) == ['"coordinator/status"']


@pytest.mark.parametrize("api", ["innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval(",
                                 "Function(", "DOMParser", "createContextualFragment", "srcdoc"])
def test_the_script_never_turns_data_into_markup(api: str) -> None:
    # Worker ids, urls and models come from heartbeats: text goes in through textContent only.
    assert api not in SCRIPT


def test_the_script_keeps_a_key_in_the_tab_and_sends_it_as_a_header() -> None:
    assert "sessionStorage.setItem" in SCRIPT and '"X-API-Key"' in SCRIPT
    for leak in ("localStorage", "console.", "searchParams", "location.search =", "location.href ="):
        assert leak not in SCRIPT, leak  # a key outlives the tab, is logged, or goes in an address
    form = re.search(r"<form [^>]*>(.*?)</form>", PAGE, flags=re.DOTALL)
    assert form is not None and "action" not in form.group(0).split(">", 1)[0]  # read by the script only
    assert re.search(r'<input id="key-input" type="password"', form.group(1))


async def test_with_api_keys_the_page_stays_open_and_its_snapshot_answers_401_without_one() -> None:
    """The page tells "a key is needed" from "unreachable" by the 401, and sends the key as X-API-Key."""
    settings = SETTINGS.model_copy(update={"api_keys": "k1,k2"})
    async with running_app(settings, FakeWorkers(), ManualClock()) as client:
        assert (await client.get("/status")).text == PAGE
        assert (await client.get("/", follow_redirects=True)).text == PAGE
        assert (await client.get("/coordinator/status")).status_code == 401
        assert (await client.get("/coordinator/status", headers={"x-api-key": "k3"})).status_code == 401
        snap = await client.get("/coordinator/status", headers={"x-api-key": "k2"})
        assert snap.status_code == 200 and snap.json()["health"]["status"] == "no_workers"


async def test_the_snapshot_holds_the_listings_and_counters_of_requests_served() -> None:
    clock = ManualClock()
    fakes = FakeWorkers({"w1": streaming(STREAM)})
    async with running_app(SETTINGS, fakes, clock) as client:
        await register(client, heartbeat("w1", timestamp=clock.time()))
        await register(client, heartbeat("w2", timestamp=clock.time(), sessions=4))  # full: w1 serves
        assert (await client.post("/coordinator/infer", json={"prompt": "hi", "max_tokens": 5})).status_code == 200
        assert (await client.post("/coordinator/infer", json={"prompt": "hi", "model": "nope"})).status_code == 404
        assert (await client.post("/coordinator/infer", content=b"{")).status_code == 400
        clock.advance(2.5)  # heartbeats 2.5 s old: both still alive (stale after 3)
        snap = (await client.get("/coordinator/status")).json()
        assert snap["now_s"] == clock.monotonic()
        assert (snap["heartbeat_interval_s"], snap["stale_after_s"], snap["dead_after_s"]) == (1.0, 3.0, 6.0)
        assert snap["health"] == (await client.get("/coordinator/health")).json()
        assert snap["workers"] == (await client.get("/coordinator/health/workers")).json()
        listed = {w["worker_id"]: w for w in snap["workers"]["workers"]}
        assert listed["w2"]["sessions"] == 4 and listed["w1"]["heartbeat_age_s"] == 2.5
        counters = snap["counters"]
        assert counters["admitted"] == 1
        assert counters["rejected"] == {"unknown_model": 1, "invalid_request": 1}
        assert counters["finished"] == {"stop": 1}
        assert counters["generation_tokens"] == 3
        assert (counters["ttft_count"], counters["e2e_count"]) == (1, 1)
        assert (counters["queue_length"], counters["failovers"], counters["session_moves"]) == (0, 0, {})
        clock.advance(1.0)
        later = (await client.get("/coordinator/status")).json()
        assert {w["worker_id"]: w["state"] for w in later["workers"]["workers"]} == {"w1": "stale", "w2": "stale"}
        assert later["health"]["status"] == "no_workers"


def _metrics(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    out = {}
    for line in text.splitlines():
        if line.startswith("#") or not line:
            continue
        sample, value = line.rsplit(" ", 1)
        name, _, labels = sample.partition("{")
        pairs = frozenset(tuple(p.split("=", 1)) for p in re.findall(r'(\w+="[^"]*")', labels))
        out[(name, frozenset((k, v.strip('"')) for k, v in pairs))] = float(value)
    return out


async def test_the_counters_agree_with_metrics_after_a_mix_of_outcomes() -> None:
    """Invariant: every number in the snapshot's counters is the one /metrics reports."""
    clock = ManualClock()
    fakes = FakeWorkers({"w1": streaming(STREAM), "w2": streaming(STREAM, fail_after=True)})
    async with running_app(SETTINGS, fakes, clock) as client:
        for worker_id in ("w1", "w2"):
            await register(client, heartbeat(worker_id, timestamp=clock.time()))
        bodies: list[bytes] = [
            json.dumps({"prompt": f"p{i}", "max_tokens": 4}).encode() for i in range(6)] + [
            b"{", json.dumps({"prompt": "x", "model": "other"}).encode(), b'{"prompt": ""}']
        for body in bodies:
            await client.post("/coordinator/infer", content=body)
        await register(client, heartbeat("w1", timestamp=clock.time(), sessions=4))
        await register(client, heartbeat("w2", timestamp=clock.time(), sessions=4))
        assert (await client.post("/coordinator/infer", json={"prompt": "x"})).status_code == 503
        counters = (await client.get("/coordinator/status")).json()["counters"]
        m = _metrics((await client.get("/metrics")).text)

    def value(name: str, **labels: str) -> float:
        return m.get((name, frozenset(labels.items())), 0.0)

    assert counters["admitted"] == value("coordinator_admission_decisions_total", outcome="admitted", reason="") == 6
    rejected = {dict(k[1])["reason"]: v for k, v in m.items()
                if k[0] == "coordinator_admission_decisions_total" and dict(k[1])["outcome"] == "rejected"}
    assert counters["rejected"] == rejected and sum(rejected.values()) == 4
    finished = {dict(k[1])["finish_reason"]: v for k, v in m.items()
                if k[0] == "coordinator_request_finished_total"}
    assert counters["finished"] == finished and sum(finished.values()) == 6
    assert counters["generation_tokens"] == value("coordinator_generation_tokens_total") > 0
    assert counters["ttft_count"] == value("coordinator_time_to_first_token_seconds_count")
    assert counters["ttft_sum_s"] == value("coordinator_time_to_first_token_seconds_sum")
    assert counters["e2e_count"] == value("coordinator_e2e_request_latency_seconds_count") == 6
    assert counters["e2e_sum_s"] == value("coordinator_e2e_request_latency_seconds_sum")


async def test_the_snapshot_is_json_a_browser_can_poll_with_no_workers() -> None:
    async with running_app(SETTINGS, FakeWorkers(), ManualClock()) as client:
        response = await client.get("/coordinator/status")
        assert response.status_code == 200 and response.headers["content-type"] == "application/json"
        snap = response.json()
        assert snap["workers"]["workers"] == [] and snap["health"]["status"] == "no_workers"
        assert snap["counters"]["rejected"] == {} and snap["counters"]["admitted"] == 0



async def test_the_snapshot_holds_each_tenants_usage() -> None:
    clock = ManualClock()
    fakes = FakeWorkers({"w1": streaming(STREAM, prompt_tokens=7)})
    settings = SETTINGS.model_copy(update={"api_keys": "a-key acme,b-key bravo rpm=1"})
    async with running_app(settings, fakes, clock) as client:
        await register(client, heartbeat("w1", timestamp=clock.time()))
        for key in ("a-key", "b-key", "b-key"):  # b's second is over its limit
            await client.post("/coordinator/infer", json={"prompt": "hi", "max_tokens": 5}, headers={"x-api-key": key})
        tenants = (await client.get("/coordinator/status", headers={"x-api-key": "a-key"})).json()["counters"]["tenants"]
        assert tenants["t:acme"] == {"prompt_tokens": 7, "generated_tokens": 3, "queue_waits": 0, "refused": {},
                                     "counter": 7 + 2 * 3}
        assert tenants["t:bravo"]["refused"] == {"rate_limited": 1} and tenants["t:bravo"]["generated_tokens"] == 3
