"""Claude Code, headless (`claude -p`), against a real pool with the default model: the session completes with
no protocol error and no fallback warning, and a prompt too long for the model is reported as such.

Claude Code 2.1.332 (scripts/agent-clis.sh installs it in .agents/) speaks Anthropic's Messages API to
`ANTHROPIC_BASE_URL`. Its own system prompt and tool definitions are some 15,000 tokens, more than
SmolLM2-135M's 8,192-token context, so the session that must complete runs as a small model's user runs
it: `--bare --system-prompt ... --tools ""` (about 100 tokens). Everything stays on 127.0.0.1: the
environment holds nothing but what is set here, with Claude Code's other traffic (telemetry, error
reports, updates) turned off. Every run has a time limit, and its process group is killed if it passes it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.conftest import alive_worker, start_coordinator, start_worker, stop_all
from tests.polling import wait_until

pytestmark = pytest.mark.model
ROOT = Path(__file__).resolve().parents[2]
CLAUDE = ROOT / ".agents" / "node_modules" / ".bin" / "claude"
MODEL = "smollm2-135m-8k-lc100k-mix1-ep2"
SESSION_TOKENS = 4096
RUN_TIMEOUT = 240  # seconds for one `claude -p` (an answer that runs to max_tokens is continued a few times)
SMALL = ["--bare", "--system-prompt", "You are a terse assistant. Answer in one short sentence.", "--tools", ""]


@pytest.fixture(scope="module")
def pool(model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """A coordinator and one worker whose sessions hold SESSION_TOKENS; the URL and the coordinator's log."""
    logs = tmp_path_factory.mktemp("claude-code-pool")
    coordinator, url = start_coordinator(logs, "coordinator", "--heartbeat-interval", "1")
    worker, _ = start_worker(logs, "w1", url, model_path, "--threads", "1", "--heartbeat-interval", "0.5",
                             "--max-sessions", "2", "--session-max-tokens", str(SESSION_TOKENS))
    try:
        wait_until(lambda: alive_worker(url, "w1") is not None, 60, "the worker to register", interval=0.2)
        yield url, coordinator.log_path
    finally:
        stop_all([worker, coordinator])


def claude(url: str, home: Path, *flags: str, window: int | None = SESSION_TOKENS) -> subprocess.CompletedProcess[str]:
    """`claude -p` against `url`, in a bare environment, told the model's context `window` (None: left to
    Claude Code, which then assumes 1M tokens); killed with its children past RUN_TIMEOUT."""
    if not CLAUDE.exists():
        pytest.fail(f"{CLAUDE} is missing: run scripts/agent-clis.sh (it installs Claude Code 2.1.332)")
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(home), "ANTHROPIC_BASE_URL": url,
           "ANTHROPIC_API_KEY": "unused", "CLAUDE_CODE_MAX_OUTPUT_TOKENS": "1024", "API_TIMEOUT_MS": "120000", "DISABLE_TELEMETRY": "1",
           "DISABLE_ERROR_REPORTING": "1", "DISABLE_AUTOUPDATER": "1", "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1"}
    if window is not None:
        env["CLAUDE_CODE_MAX_CONTEXT_TOKENS"] = str(window)
    process = subprocess.Popen([str(CLAUDE), "-p", "Say hello", "--model", MODEL, *flags], cwd=home, env=env,
                               stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               start_new_session=True)
    try:
        out, err = process.communicate(timeout=RUN_TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.communicate()
        pytest.fail(f"claude -p ran past {RUN_TIMEOUT} s")
    return subprocess.CompletedProcess(process.args, process.returncode, out, err)


def requests(log: Path) -> list[dict[str, object]]:
    """The coordinator's log lines of Messages requests (a refused one's comes after the logger's prefix)."""
    lines = (json.loads(line[line.index("{"):]) for line in log.read_text().splitlines() if '"surface"' in line)
    return [line for line in lines if line.get("event") == "request" and line.get("surface") == "anthropic-messages"]


def served_since(log: Path, before: int) -> list[dict[str, object]]:
    """The Messages requests logged after the first `before`, once the log shows one."""
    wait_until(lambda: len(requests(log)) > before, 10, "the coordinator to log the requests", interval=0.2)
    return requests(log)[before:]


def test_a_headless_session_completes(pool: tuple[str, Path], tmp_path: Path) -> None:
    url, log = pool
    before = len(requests(log))
    run = claude(url, tmp_path, *SMALL)
    assert run.returncode == 0, (run.stdout, run.stderr)
    assert run.stdout.strip(), run.stderr
    assert "API Error" not in run.stdout + run.stderr
    assert "doesn't recognize the model" not in run.stderr  # the window is set: no 1M-token fallback
    served = served_since(log, before)
    assert served and all(r["status"] == 200 for r in served), served


def test_its_whole_prompt_is_refused_as_too_long_and_said_so(pool: tuple[str, Path], tmp_path: Path) -> None:
    url, log = pool
    before = len(requests(log))
    run = claude(url, tmp_path, window=None)  # told the real window, Claude Code refuses it without asking
    assert run.returncode == 1, (run.stdout, run.stderr)
    assert "Prompt is too long" in run.stdout + run.stderr
    served = served_since(log, before)
    assert served and all(r["reason"] == "prompt_too_long" for r in served), served
