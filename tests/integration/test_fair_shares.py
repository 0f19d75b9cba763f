"""Fair shares with two real coordinators: the counters do not split by coordinator. A tenant served
only through one coordinator has, at the other, the same counter, read off the worker's heartbeats
(`load.tenants`), its lift back from idle included, once the beats have caught up (within a beat of
each other, the order two coordinators learn of events in can differ by one lift: the bound in
docs/reliability.md)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.integration.conftest import Proc, start_coordinator, start_worker, stop_all
from tests.polling import wait_until

pytestmark = pytest.mark.model
INTERVAL = 0.5
KEYS = "heavy-key heavy,light-key light"


@pytest.fixture
def pool(tiny_model_path: Path, tmp_path: Path) -> Iterator[tuple[str, str]]:
    procs: list[Proc] = []
    try:
        urls = []
        for name in ("c1", "c2"):
            # No idle grace: a tenant lingers as active only at the coordinator it left, which would
            # make the next lift differ by design (docs/reliability.md).
            proc, url = start_coordinator(tmp_path, name, "--heartbeat-interval", str(INTERVAL), "--api-keys", KEYS,
                                          "--open-metrics", "true", "--fair-idle-grace", "0")
            procs.append(proc)
            urls.append(url)
        worker, _ = start_worker(tmp_path, "w1", ",".join(urls), tiny_model_path, "--threads", "1",
                                 "--max-sessions", "4", "--heartbeat-interval", str(INTERVAL / 2))
        procs.append(worker)
        for url in urls:
            wait_until(lambda url=url: httpx.get(url + "/coordinator/health", timeout=2).json()["workers"]["alive"] == 1,
                       60, f"w1 alive at {url}")
        yield urls[0], urls[1]
    finally:
        stop_all(reversed(procs))


def tenants(url: str) -> dict[str, dict[str, float]]:
    return dict(httpx.get(url + "/coordinator/status", timeout=5).json()["counters"]["tenants"])


def generate(url: str, key: str, max_tokens: int) -> dict[str, int]:
    with httpx.stream("POST", url + "/coordinator/infer", timeout=60, headers={"authorization": f"Bearer {key}"},
                      json={"prompt": "Say hello.", "max_tokens": max_tokens, "ignore_eos": True}) as response:
        assert response.status_code == 200, response.read()
        lines = [line for line in response.iter_lines() if line.startswith("data: ")]
    done = json.loads(lines[-1][6:])
    assert done.get("finished") and done["usage"]["completion_tokens"] == max_tokens, done
    return dict(done["usage"])


def test_a_tenant_served_through_one_coordinator_has_the_same_counter_at_the_other(pool: tuple[str, str]) -> None:
    c1, c2 = pool
    served = [generate(c1, "heavy-key", 8) for _ in range(3)]
    expected = sum(u["prompt_tokens"] + 2 * u["completion_tokens"] for u in served)  # the default weights
    assert tenants(c1)["t:heavy"]["counter"] == expected  # charged as it was served
    # c2 served none of it: it learns it from the worker's next beats (sent at once as sequences free).
    wait_until(lambda: tenants(c2).get("t:heavy", {}).get("counter") == expected, 10,
               "c2 to count the service c1's requests were given")
    # And what each served itself is counted once by each, the lift of a tenant back from idle too:
    # light, idle until now, starts level with heavy wherever it is counted.
    generate(c2, "light-key", 4)
    wait_until(lambda: tenants(c1).get("t:light", {}).get("counter") == tenants(c2)["t:light"]["counter"], 10,
               "c1 to count light as c2 does")
    assert tenants(c2)["t:light"]["counter"] > expected  # lifted to heavy's, then its own service
    generate(c1, "heavy-key", 4)
    wait_until(lambda: tenants(c2)["t:heavy"]["counter"] == tenants(c1)["t:heavy"]["counter"], 10,
               "c2 to count heavy as c1 does")
