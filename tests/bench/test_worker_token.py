"""bench.worker_token and its users: where a benchmark finds a running pool's worker token, and that
every read of a worker's guarded routes (`/metrics`, generate) carries it to a real worker that
checks it, so a missing header fails loudly instead of reading zeros."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from bench.load.command import main as load_main
from bench.prefix_bench import prompt_counters
from bench.processes import peer_env, pool
from bench.worker_token import FILE_NAME, auth_headers, find_token
from tests.threaded_server import serving
from worker.api.app import create_app
from worker.settings import WorkerSettings

# starts a pool as its own processes
pytestmark = pytest.mark.process

TOKEN = "s3cret-token"


def finished(worker_url: str, worker_token: str) -> float:
    """The worker's finished requests, read with the token (bench/policy_bench.py's read, retired in
    7737c5b: `git show 7737c5b:bench/policy_bench.py`)."""
    response = httpx.get(worker_url + "/metrics", headers=auth_headers(worker_token), timeout=5)
    text = response.raise_for_status().text
    return sum(float(m.group(1)) for m in re.finditer(r"^worker_requests_finished_total\{[^}]*\} (\S+)", text, re.MULTILINE))


@pytest.mark.parametrize("flag,env,file_text,expected", [
    ("from-flag", {"WORKER_TOKEN": "from-env"}, "from-file\n", "from-flag"),
    (None, {"WORKER_TOKEN": "from-env"}, "from-file\n", "from-env"),
    (None, {"WORKER_TOKEN": ""}, "from-file\n", "from-file"),  # start.sh's file, newline stripped
    (None, {}, "from-file\n", "from-file"),
    (None, {}, "\n", None),
    (None, {}, None, None),  # LOG_DIR without the file: a pool started with --no-worker-token
])
def test_find_token_takes_the_flag_then_the_environment_then_start_shs_file(
        tmp_path: Path, flag: str | None, env: dict[str, str], file_text: str | None, expected: str | None) -> None:
    if file_text is not None:
        (tmp_path / FILE_NAME).write_text(file_text)
    assert find_token(flag, {**env, "LOG_DIR": str(tmp_path)}) == expected


def test_find_token_without_log_dir_and_auth_headers() -> None:
    assert find_token(None, {}) is None
    assert auth_headers(None) == {} and auth_headers("") == {}
    assert auth_headers("t") == {"authorization": "Bearer t"}


def test_peer_env_sets_exactly_the_token_it_is_given(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORKER_TOKEN", "from-the-shell")
    monkeypatch.setenv("SOME_OTHER", "kept")
    assert "WORKER_TOKEN" not in peer_env(None) and peer_env(None)["SOME_OTHER"] == "kept"
    assert peer_env("mine")["WORKER_TOKEN"] == "mine"


@pytest.fixture
def guarded_worker() -> Iterator[str]:
    """A real worker app (simulated engine) that asks for TOKEN on every route but health."""
    app = create_app(WorkerSettings(engine="simulated", coordinator_url="", worker_token=TOKEN,
                                    sim_token_rate=1000, log_level="warning"))
    with serving(app, timeout=20) as url:
        deadline = time.monotonic() + 20
        while httpx.get(url + "/worker/health", timeout=2).status_code != 200:
            assert time.monotonic() < deadline, "worker did not become ready"
            time.sleep(0.05)
        yield url


def test_metric_reads_carry_the_token_and_fail_without_it(guarded_worker: str) -> None:
    assert finished(guarded_worker, TOKEN) == 0.0
    assert prompt_counters(guarded_worker, TOKEN) == (0.0, 0.0, 0.0)
    for read in (finished, prompt_counters):
        with pytest.raises(httpx.HTTPStatusError) as refused:
            read(guarded_worker, "wrong")
        assert refused.value.response.status_code == 401


def test_load_tool_finds_start_shs_token_for_api_worker_and_keeps_it_out_of_the_results(
        guarded_worker: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    argv = ["--url", guarded_worker, "--api", "worker", "--requests", "3", "--max-tokens", "2", "--raw",
            "--no-progress", "--timeout", "10"]
    monkeypatch.delenv("WORKER_TOKEN", raising=False)
    monkeypatch.setenv("LOG_DIR", str(tmp_path))
    assert load_main([*argv, "--out", str(tmp_path / "without.json")]) == 1  # every request refused: 401
    (tmp_path / FILE_NAME).write_text(TOKEN + "\n")
    from_file = tmp_path / "from-file.json"
    assert load_main([*argv, "--out", str(from_file)]) == 0
    assert json.loads(from_file.read_text())["targets"]["target"][0]["summary"]["successes"] == 3
    monkeypatch.delenv("LOG_DIR")
    from_flag = tmp_path / "from-flag.json"
    assert load_main([*argv, "--worker-token", TOKEN, "--out", str(from_flag)]) == 0
    assert finished(guarded_worker, TOKEN) == 6.0
    assert TOKEN not in from_flag.read_text()


def test_a_pool_starts_its_workers_with_the_token_it_reports(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A real coordinator and a simulated worker as the benchmarks start them: the worker registers
    (its heartbeats carry the pool's token), reads with `Pool.worker_token` pass, and the shell's
    WORKER_TOKEN does not leak in."""
    monkeypatch.setenv("WORKER_TOKEN", "from-the-shell")
    with pool(tmp_path, workers=[["--engine", "simulated"]], timeout=30) as running:
        assert running.worker_token not in ("", "from-the-shell")
        (worker,) = running.worker_urls
        assert finished(worker, running.worker_token) == 0.0
        for token in ("from-the-shell", ""):
            with pytest.raises(httpx.HTTPStatusError):
                finished(worker, token)
