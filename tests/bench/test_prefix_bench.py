"""bench.prefix_bench's `--keys`: the coordinator's API_KEYS entries and each user's key, and that a pool
started with them asks for a key (and one exported in the shell does not leak in)."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from bench.prefix_bench import SHARED_TENANT, main, user_keys
from bench.processes import pool

# starts a pool (coordinators and workers) as its own processes
pytestmark = pytest.mark.process

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "temperature": 0}


def test_no_keys_means_no_setting_and_no_key_for_anyone() -> None:
    assert user_keys("none", 3) == (None, [None, None, None])


@pytest.mark.parametrize("keys,suffix", [("per-user", ""), ("shared", f" {SHARED_TENANT}")])
def test_one_key_per_user_each_its_own_entry(keys: str, suffix: str) -> None:
    setting, mine = user_keys(keys, 4)
    assert setting is not None and len(set(mine)) == 4 and all(mine)
    assert setting.split(",") == [f"{key}{suffix}" for key in mine]  # per-user: no tenant named, each its own


def test_an_unknown_keys_mode_is_refused() -> None:
    with pytest.raises(ValueError, match="--keys"):
        user_keys("per-tenant", 2)
    with pytest.raises(SystemExit):
        main(["--keys", "per-tenant"])


def test_a_pool_with_keys_asks_for_one_and_the_shells_keys_stay_out(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("API_KEYS", "from-the-shell")
    setting, (first, second) = user_keys("shared", 2)
    with pool(tmp_path, workers=[["--engine", "simulated"]], api_keys=setting, timeout=30) as running:
        url = running.url + "/v1/chat/completions"
        for key in (first, second):
            assert httpx.post(url, json=CHAT, headers={"authorization": f"Bearer {key}"}, timeout=30).status_code == 200
        for headers in ({}, {"authorization": "Bearer from-the-shell"}):
            assert httpx.post(url, json=CHAT, headers=headers, timeout=30).status_code == 401
            assert httpx.get(running.url + "/metrics", headers=headers, timeout=10).status_code == 401
    with pool(tmp_path, workers=[["--engine", "simulated"]], timeout=30) as running:
        assert httpx.post(running.url + "/v1/chat/completions", json=CHAT, timeout=30).status_code == 200


def test_a_pool_of_two_coordinators_has_every_worker_registered_with_both(tmp_path: Path) -> None:
    with pool(tmp_path, workers=[["--engine", "simulated"]] * 2, timeout=30, coordinators=2) as running:
        assert len(set(running.urls)) == 2 and running.url == running.urls[0]
        for url in running.urls:
            assert httpx.get(url + "/coordinator/health", timeout=5).json()["workers"]["alive"] == 2
            assert httpx.post(url + "/v1/chat/completions", json=CHAT, timeout=30).status_code == 200
