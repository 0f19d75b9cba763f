"""The status page in a real headless Chromium (Debian's, through Selenium) against a real pool: a
coordinator and two workers serving the real model. It checks that the page renders both workers,
that its counters and charts move with the requests served, that data from a heartbeat is shown as
text and never run, that a stopped worker shows as late, then stale, then alive again once resumed,
then gone once killed, and that a stopped coordinator shows as unreachable; each within a few seconds.
Against a coordinator that needs client API keys it checks the page's key prompt: asked for, a
wrong key refused, a right one typed or given in the link's fragment, kept in sessionStorage only.

`scripts/test-deps.sh` installs the browser (as root). A machine without it fails here with that
instruction; it never passes silently. The screenshot goes to the test's tmp dir, and also to
$STATUS_PAGE_SCREENSHOT when set (docs/img/status-page.png was made that way).
"""

from __future__ import annotations

import asyncio
import http.server
import os
import shutil
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Self

import httpx
import pytest

from coordinator.ops import status_page
from coordinator.ops.status_page import Counters, StatusSnapshot
from protocol.coordinator import CoordinatorHealth, WorkerCounts, WorkerStatus, WorkerStatusList
from tests.integration.conftest import TOKEN, Cluster, running_cluster, start_coordinator

pytestmark = pytest.mark.model

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
CHROMIUM_FLAGS = ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--disable-dev-shm-usage", "--window-size=1400,900"]
HOSTILE = '<img src=x onerror="document.title=\'pwned\'">'
PROMPTS = ["Write a haiku about the sea.", "What is the capital of France?", "Name three colours.",
           "Explain rain to a child.", "Give me a short greeting.", "Count from one to five."]
LOAD_USERS = 3
# The light load's length; STATUS_PAGE_LOAD_SECONDS makes it longer for a screenshot with more history.
LOAD_SECONDS = float(os.environ.get("STATUS_PAGE_LOAD_SECONDS", "4"))
API_KEYS = ("status-key-1", "status+key/2")  # in a fragment, the second's "+" must stay a plus

# What the page shows, read from its DOM in one call.
READ_PAGE = """
const text = (id) => document.getElementById(id).textContent;
const rows = [...document.querySelectorAll('#workers tr')].map((tr) => {
  const cell = (f) => tr.querySelector('[data-field="' + f + '"]');
  return {id: tr.getAttribute('data-worker-id'), state: cell('state').textContent,
          heartbeat: cell('heartbeat').textContent, late: cell('heartbeat').className,
          shown_id: cell('worker').firstChild.textContent, sessions: cell('sessions').textContent,
          model: cell('model').textContent};
});
const legend = {};
for (const item of document.querySelectorAll('#admission-legend [data-outcome]')) {
  legend[item.getAttribute('data-outcome')] = Number(item.textContent.split(' ').pop().replace(/,/g, ''));
}
const chart = (id) => ({max: Number(document.getElementById(id).getAttribute('data-max')),
                        points: Number(document.getElementById(id).getAttribute('data-points') || 0)});
const keyPolls = performance.getEntriesByType('resource').filter((e) => e.name.endsWith('/coordinator/status'));
return {polls: Number(document.body.getAttribute('data-polls')), title: document.title,
        status: text('pool-status'), updated: text('updated'), rows, legend,
        admitted: Number(text('total-admitted').replace(/,/g, '')), tokens: text('total-tokens'),
        tps: chart('chart-tps'), ttft: chart('chart-ttft'), images: document.querySelectorAll('img').length,
        key: {asked: !document.getElementById('key-box').hidden, message: text('key-message'),
              typed: document.getElementById('key-input').value},
        stored: sessionStorage.getItem('llm-pool.api-key'), local: localStorage.length, href: location.href,
        fetches: keyPolls.length};
"""


@pytest.fixture(scope="module")
def pool(model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """A pool of its own (this test stops and kills its workers and its coordinator)."""
    with running_cluster(tmp_path_factory.mktemp("status-page"), model_path, "coordinator-status",
                         "--heartbeat-interval", "1", "--worker-token", TOKEN, "--retry-after", "1") as cluster:
        yield cluster


@pytest.fixture(scope="module")
def keyed_pool(model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """A coordinator that needs client API keys (for its snapshot too, by default) and one worker."""
    log_dir = tmp_path_factory.mktemp("status-page-keys")
    coordinator, url = start_coordinator(log_dir, "coordinator-keys", "--heartbeat-interval", "1",
                                         "--worker-token", TOKEN, "--api-keys", ",".join(API_KEYS))
    cluster = Cluster(log_dir, model_path, coordinator, url)
    try:
        cluster.start_worker("w1")
        cluster.ensure()
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="module")
def browser(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    missing = [str(p) for p in (CHROMIUM, CHROMEDRIVER) if not p.exists()]
    if missing:
        pytest.fail(f"the status page's browser test needs Debian's Chromium: {', '.join(missing)} missing; "
                    "run scripts/test-deps.sh as root (apt-get install -y chromium chromium-driver)")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    profile = tmp_path_factory.mktemp("chromium-profile")
    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})  # a failure reports the page's errors
    for flag in [*CHROMIUM_FLAGS, f"--user-data-dir={profile}"]:
        options.add_argument(flag)
    service = Service(executable_path=str(CHROMEDRIVER), log_output=str(profile.parent / "chromedriver.log"))
    driver = webdriver.Chrome(options=options, service=service)
    try:
        driver.set_page_load_timeout(30)
        driver.set_script_timeout(10)
        yield driver
    finally:
        driver.quit()


def shows(driver: Any, check: Any, timeout: float, what: str) -> dict[str, Any]:
    """The page's state once `check(state)` holds, polling its DOM; fails with the last state seen."""
    deadline = time.monotonic() + timeout
    while True:
        state: dict[str, Any] = driver.execute_script(READ_PAGE)
        if check(state):
            return state
        if time.monotonic() > deadline:
            errors = [e["message"] for e in driver.get_log("browser") if e["level"] == "SEVERE"]
            raise AssertionError(f"the page did not show {what} within {timeout} s; it shows {state}; "
                                 f"its console's errors: {errors}")
        time.sleep(0.1)


def row(state: dict[str, Any], worker_id: str) -> dict[str, Any]:
    return next((r for r in state["rows"] if r["id"] == worker_id), {"state": None, "late": ""})


class Load:
    """A few users sending streams back to back from threads, until stopped; counts what it got."""

    def __init__(self, url: str, users: int) -> None:
        self.url, self.statuses, self.errors, self._stop = url, list[int](), list[str](), threading.Event()
        self._threads = [threading.Thread(target=self._user, args=(i,), daemon=True) for i in range(users)]

    def __enter__(self) -> Self:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=60)

    def _user(self, i: int) -> None:
        with httpx.Client(timeout=60) as client:
            n = 0
            while not self._stop.is_set():
                body = {"prompt": PROMPTS[(i + n) % len(PROMPTS)], "max_tokens": 24 + 16 * ((i + n) % 3)}
                try:
                    response = client.post(self.url + "/coordinator/infer", json=body)
                except httpx.HTTPError as exc:
                    self.errors.append(repr(exc))
                    return
                self.statuses.append(response.status_code)
                if response.status_code != 200 or "event: done" not in response.text:
                    self.errors.append(f"{response.status_code}: {response.text[-300:]}")
                n += 1


def test_the_page_shows_the_pool_live_in_a_real_browser(pool: Cluster, browser: Any, tmp_path: Path) -> None:
    browser.get(pool.url + "/")
    assert browser.current_url == pool.url + "/status"
    state = shows(browser, lambda s: s["polls"] >= 2 and [(r["id"], r["state"]) for r in s["rows"]]
                  == [("w1", "alive"), ("w2", "alive")], 10, "both workers alive")
    assert state["status"] == "ok" and state["title"] == "llm-pool status"
    assert not state["key"]["asked"] and state["stored"] is None  # no keys configured: no prompt
    admitted_before = state["admitted"]

    # Counters and charts move with real requests; a refusal shows under its reason. The screenshot
    # is taken under that load.
    with Load(pool.url, LOAD_USERS) as load:
        time.sleep(LOAD_SECONDS / 2)
        unknown = httpx.post(pool.url + "/coordinator/infer", json={"prompt": "x", "model": "no-such-model"}, timeout=10)
        assert unknown.status_code == 404
        time.sleep(LOAD_SECONDS / 2)
        shows(browser, lambda s: s["legend"].get("unknown_model") == 1, 5, "the refusal")
        height = browser.execute_script(
            "return Math.ceil(document.querySelector('footer').getBoundingClientRect().bottom) + 4")
        browser.execute_cdp_cmd("Emulation.setDeviceMetricsOverride",  # the whole page, and nothing below it
                                {"width": 1400, "height": height, "deviceScaleFactor": 1, "mobile": False})
        shot = tmp_path / "status-page.png"
        assert browser.save_screenshot(str(shot)) and shot.stat().st_size > 10_000
    if os.environ.get("STATUS_PAGE_SCREENSHOT"):
        shutil.copyfile(shot, os.environ["STATUS_PAGE_SCREENSHOT"])
    served = load.statuses.count(200)
    assert served >= 3 and not load.errors, load.errors
    # Tokens are counted when a stream ends, after its admission: on shared cores a poll can see the
    # last admissions before the tokens of the streams they started, so the charts are waited for too.
    state = shows(browser, lambda s: s["admitted"] == admitted_before + served
                  and s["legend"].get("admitted") == served and s["legend"].get("unknown_model") == 1
                  and s["tps"]["points"] > 0 and s["ttft"]["points"] > 0, 10,
                  f"{served} more admitted, one refusal, and the token and first-token charts")
    assert state["tps"]["max"] >= 1, state["tps"]
    assert state["tokens"] != "0 tokens in all"

    # A worker stopped: late within two heartbeat intervals, stale at three (the coordinator's
    # --heartbeat-interval 1), alive again once it resumes, gone once it is killed and removed.
    worker = pool.workers["w2"]
    worker.signal(signal.SIGSTOP)
    stopped = time.monotonic()
    try:
        shows(browser, lambda s: "late" in row(s, "w2")["late"], 4, "w2's heartbeat late")
        late_after = time.monotonic() - stopped
        shows(browser, lambda s: row(s, "w2")["state"] == "stale", 6, "w2 stale")
        stale_after = time.monotonic() - stopped
        assert row(shows(browser, lambda s: True, 0, ""), "w1")["state"] == "alive"
    finally:
        worker.signal(signal.SIGCONT)
    shows(browser, lambda s: row(s, "w2")["state"] == "alive" and row(s, "w2")["late"].split() == ["age"], 5,
          "w2 alive again")
    worker.signal(signal.SIGKILL)
    killed = time.monotonic()
    shows(browser, lambda s: row(s, "w2")["state"] == "gone", 10, "w2 gone")
    gone_after = time.monotonic() - killed
    print(f"status page: w2 late after {late_after:.1f} s, stale after {stale_after:.1f} s, "
          f"gone {gone_after:.1f} s after SIGKILL")

    # The coordinator gone: the page says so and keeps polling.
    pool.coordinator.stop()
    shows(browser, lambda s: s["status"] == "unreachable" and "unreachable" in s["updated"], 6,
          "the coordinator unreachable")


def hostile_snapshot(n: int) -> StatusSnapshot:
    """Markup in every string the page shows. The coordinator's heartbeat validation keeps such ids
    out today; the page must not depend on that."""
    worker = WorkerStatus(worker_id=HOSTILE, url=HOSTILE, model=HOSTILE, state="alive", heartbeat_age_s=0.1,
                          sessions=1, max_sessions=4, active_streams=1, queue_depth=0, kv_used_bytes=10,
                          kv_reserved_bytes=20, kv_capacity_bytes=100, bytes_per_token=1, session_max_tokens=50,
                          draining=False, score=0.5, score_parts={HOSTILE: 0.5})
    swapping = worker.model_copy(update={"worker_id": "swapper", "model": "small", "draining": True,
                                         "swapping": HOSTILE, "last_swap_s": 2.5})  # a swap under way, to markup
    return StatusSnapshot(
        now_s=time.monotonic(), heartbeat_interval_s=1, stale_after_s=3, dead_after_s=6,
        health=CoordinatorHealth(status="ok", workers=WorkerCounts(alive=1, stale=0, total=1), models=[HOSTILE],
                                 requests_running=1, kv_reserved_bytes=20),
        workers=WorkerStatusList(routing_policy=HOSTILE, scorers=HOSTILE, workers=[worker, swapping]),
        counters=Counters(admitted=n, rejected={HOSTILE: n}, queue_outcomes={HOSTILE: n}, queue_length=0,
                          finished={HOSTILE: n}, failovers=0, generation_tokens=10 * n, ttft_count=n,
                          ttft_sum_s=0.1 * n, e2e_count=n, e2e_sum_s=n))


def test_the_page_shows_markup_in_its_data_as_text(browser: Any) -> None:
    """The real page and its CSP, served beside a snapshot full of markup."""
    page = asyncio.run(status_page.page())
    polled = iter(range(1, 10_000))

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path == "/status":
                body, headers = bytes(page.body), dict(page.headers)
            else:
                body, headers = hostile_snapshot(next(polled)).model_dump_json().encode(), {
                    "content-type": "application/json"}
            self.send_response(200)
            for name, value in {**headers, "content-length": str(len(body))}.items():
                self.send_header(name, value)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        browser.get(f"http://127.0.0.1:{server.server_port}/status")
        state = shows(browser, lambda s: row(s, HOSTILE)["state"] == "alive" and HOSTILE in s["legend"], 10,
                      "the worker and the refusal reason named in markup")
        assert row(state, HOSTILE)["shown_id"] == HOSTILE
        assert (row(state, "swapper")["state"], row(state, "swapper")["model"]) == (
            "swapping", "small \u2192 " + HOSTILE + " (swap 2.5 s)")
        assert state["images"] == 0 and state["title"] == "llm-pool status"
        assert HOSTILE in browser.find_element("id", "policy").text
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


def enter_key(driver: Any, key: str) -> None:
    field = driver.find_element("id", "key-input")
    assert field.get_attribute("type") == "password"
    field.send_keys(key)
    driver.find_element("id", "key-submit").click()


def live_with_w1(state: dict[str, Any]) -> bool:
    return bool(state["polls"] >= 2 and [(r["id"], r["state"]) for r in state["rows"]] == [("w1", "alive")])


def test_the_page_asks_for_an_api_key_when_the_coordinator_needs_one(keyed_pool: Cluster, browser: Any) -> None:
    url = keyed_pool.url
    assert httpx.get(url + "/coordinator/status", timeout=5).status_code == 401  # what the page meets
    browser.get(url + "/status")  # an origin (port) of its own: nothing stored for it yet

    # Asked for a key, and not polling meanwhile (each refusal counts as an unauthorized request).
    state = shows(browser, lambda s: s["key"]["asked"], 10, "the key prompt")
    assert state["status"] == "key needed" and "is needed" in state["key"]["message"] and state["rows"] == []
    time.sleep(1)  # the refused poll's timing entry is written once its body is read
    fetched = shows(browser, lambda s: True, 0, "")["fetches"]
    time.sleep(2.5)
    assert shows(browser, lambda s: True, 0, "")["fetches"] == fetched == 1

    # A wrong key: refused, forgotten, asked again.
    enter_key(browser, "not-" + API_KEYS[0])
    state = shows(browser, lambda s: s["key"]["asked"] and "refused" in s["key"]["message"], 10,
                  "the key refused")
    assert state["status"] == "key needed" and state["stored"] is None and state["key"]["typed"] == ""

    # The right key, typed: live, kept for this tab only, nowhere in the address.
    enter_key(browser, API_KEYS[0])
    state = shows(browser, live_with_w1, 10, "w1 alive, read with the typed key")
    assert state["status"] == "ok" and not state["key"]["asked"] and state["key"]["typed"] == ""
    assert state["stored"] == API_KEYS[0] and state["local"] == 0 and state["href"] == url + "/status"
    browser.refresh()  # the tab keeps it
    state = shows(browser, live_with_w1, 10, "w1 alive after a reload, with the kept key")
    assert not state["key"]["asked"] and state["stored"] == API_KEYS[0]

    # The key in a link's fragment (a fresh load, not a same-page hash change): used without typing,
    # then gone from the address bar.
    browser.execute_script("sessionStorage.clear()")
    browser.get("about:blank")
    browser.get(url + "/status#key=" + API_KEYS[1])
    state = shows(browser, live_with_w1, 10, "w1 alive, read with the fragment's key")
    assert not state["key"]["asked"] and state["stored"] == API_KEYS[1] and state["local"] == 0
    assert state["href"] == url + "/status" and browser.current_url == url + "/status"

    # A refused key in a fragment: the prompt, saying so.
    browser.execute_script("sessionStorage.clear()")
    browser.get("about:blank")
    browser.get(url + "/status#key=wrong")
    state = shows(browser, lambda s: s["key"]["asked"] and "refused" in s["key"]["message"], 10,
                  "the fragment's key refused")
    assert state["href"] == url + "/status" and state["stored"] is None and state["polls"] == 0
