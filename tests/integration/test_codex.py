"""Codex CLI, headless, against a real pool with the default model: `codex exec` with a provider whose
`base_url` is the pool and `wire_api = "responses"`, as its users configure it. Its run must complete
over the Responses WebSocket (which it opens first, with `generate: false`, then continues with
`previous_response_id`), with no protocol error and no fallback: neither to HTTP nor to its fallback
model metadata (the catalog below names the pool's model).

Codex's own prompt (instructions, tools, skills, permissions, environment) is about 6,400 tokens of
SmolLM2 with its defaults: over the default WORKER_SESSION_MAX_TOKENS (2048), and a prefill of minutes on
one shared core. The configuration here keeps it to about 1,400 (short instructions, no web search, no
sub-agents, no goals, no image tool), which the default worker serves.

The 135M model's answers do not matter, but sampling at the pool's default temperature it sometimes
rambles until its KV limit, and Codex ends such a turn with "Incomplete response returned, reason:
max_output_tokens" (exit 1): that outcome, and only that, is run once more.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.integration.agent_pool import agent_pool
from tests.integration.conftest import clean_env

pytestmark = pytest.mark.process
CODEX = Path(__file__).resolve().parents[2] / ".agents" / "node_modules" / ".bin" / "codex"
MODEL = "smollm2-135m-8k-lc100k-mix1-ep2"
INCOMPLETE = "Incomplete response returned, reason: max_output_tokens"
CATALOG = {"models": [{
    "slug": MODEL, "display_name": "SmolLM2 135M", "description": "the pool's default model",
    "default_reasoning_level": "none", "supported_reasoning_levels": [], "shell_type": "default",
    "visibility": "list", "supported_in_api": True, "priority": 1, "context_window": 2048,
    "truncation_policy": {"mode": "tokens", "limit": 1000}, "supports_parallel_tool_calls": False,
    "input_modalities": ["text"], "prefer_websockets": True, "support_verbosity": False,
    "apply_patch_tool_type": None, "experimental_supported_tools": [], "supports_reasoning_summaries": False,
    "base_instructions": "You are a coding agent. Answer briefly."}]}


def _config(home: Path, url: str) -> None:
    (home / "instructions.md").write_text("You are a coding agent. Answer briefly.\n")
    (home / "catalog.json").write_text(json.dumps(CATALOG))
    (home / "config.toml").write_text(f'''
model = "{MODEL}"
model_provider = "pool"
check_for_update_on_startup = false
model_instructions_file = "{home / "instructions.md"}"
model_catalog_json = "{home / "catalog.json"}"
web_search = "disabled"
include_permissions_instructions = false
include_environment_context = false

[agents]
enabled = false

[features]
goals = false

[tools]
view_image = false

[analytics]
enabled = false

[model_providers.pool]
name = "pool"
base_url = "{url}/v1"
wire_api = "responses"
env_key = "POOL_API_KEY"
supports_websockets = true
request_max_retries = 0
stream_max_retries = 0
''')


def _exec(home: Path, work: Path) -> subprocess.CompletedProcess[str]:
    env = {**clean_env(), "CODEX_HOME": str(home), "POOL_API_KEY": "unused", "HOME": str(home),
           "PATH": os.environ.get("PATH", "")}
    return subprocess.run([str(CODEX), "exec", "--skip-git-repo-check", "Reply with one word: hi"], cwd=work,
                          env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=240,
                          check=False)


@pytest.mark.skipif(not CODEX.exists(), reason="Codex CLI is not installed (scripts/agent-clis.sh)")
def test_codex_exec_completes_over_the_websocket(model_path: Path, tmp_path: Path) -> None:
    home, work = tmp_path / "codex-home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    with agent_pool(tmp_path, model_path) as url:
        _config(home, url)
        run = _exec(home, work)
        if run.returncode != 0 and INCOMPLETE in run.stderr + run.stdout:
            run = _exec(home, work)
    said = run.stdout + run.stderr
    assert run.returncode == 0, said[-3000:]
    assert "fallback" not in said.lower() and "falling back" not in said.lower(), said[-3000:]
    requests = [json.loads(line) for line in (tmp_path / "coordinator.log").read_text().splitlines()
                if line.startswith('{"event":"request"')]
    assert requests and all(r["surface"] == "openai-responses-socket" for r in requests), requests
    assert all(r["status"] == 200 for r in requests), requests
