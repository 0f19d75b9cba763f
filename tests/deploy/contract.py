"""What the deploy files may assume about the code, read from the code itself: each service's
environment names (coordinator/settings.py, worker/settings.py), its default port, its drain
timeout, the GET routes its app serves and the console scripts pyproject.toml installs.
The tests hold compose.yaml and the Kubernetes manifests to these, so neither can drift from the code.
"""

from __future__ import annotations

import functools
import re
import tomllib
from typing import Any

from coordinator.settings import Settings
from tests.deploy.manifests import ROOT
from worker.settings import ENV_NAMES, WorkerSettings

# Environment a worker pod sets only for `$(NAME)` expansion in the settings' values (downward API).
DOWNWARD_API = {"POD_IP": "status.podIP", "POD_NAME": "metadata.name"}
# What the provisioning step (python -m worker.provision, flags only) gets: pip needs a writable HOME.
PROVISION_ENV = {"HOME", "PIP_NO_CACHE_DIR"}


def env_names(role: str) -> set[str]:
    """The environment names a service reads today."""
    if role == "coordinator":
        return {name.upper() for name in Settings.model_fields}
    if role == "worker":
        return set(ENV_NAMES.values())
    raise ValueError(role)


def default_port(role: str) -> int:
    return Settings().port if role == "coordinator" else WorkerSettings(engine="simulated").port


# What a shutdown takes besides the drain itself: the error events' flush (2 s, coordinator/ops/drain.py
# and worker/runtime.py), the server's graceful shutdown (uvicorn, 5 s) and a worker's draining
# heartbeat (up to 5 s when the coordinator is unreachable).
SHUTDOWN_BESIDES_DRAIN = 12.0


def drain_timeout(role: str, env: dict[str, str]) -> float:
    """The drain timeout a container runs with: its env value, else the code's default."""
    name = "DRAIN_TIMEOUT" if role == "coordinator" else "WORKER_DRAIN_TIMEOUT"
    if name in env:
        return float(env[name])
    return float((Settings if role == "coordinator" else WorkerSettings).model_fields["drain_timeout"].default)


@functools.cache
def get_routes(role: str) -> frozenset[str]:
    """Paths the service's app answers GET on (from the apps themselves, via their OpenAPI schema)."""
    if role == "coordinator":
        from coordinator.app import create_app as coordinator_app

        app = coordinator_app(Settings())
    else:
        from worker.api.app import create_app as worker_app

        app = worker_app(WorkerSettings(engine="simulated", coordinator_url=""))
    paths: dict[str, Any] = app.openapi()["paths"]
    return frozenset(path for path, operations in paths.items() if "get" in operations)


def console_scripts() -> set[str]:
    with (ROOT / "pyproject.toml").open("rb") as handle:
        return set(tomllib.load(handle)["project"]["scripts"])


def llama_cpp_pin() -> str:
    """The llama-cpp-python requirement in pyproject.toml's runtime dependencies."""
    with (ROOT / "pyproject.toml").open("rb") as handle:
        dependencies = tomllib.load(handle)["project"]["dependencies"]
    pins = [d for d in dependencies if re.match(r"llama-cpp-python\s*==", d)]
    assert len(pins) == 1, dependencies
    return re.sub(r"\s", "", pins[0])


def role_of(command: list[str]) -> str:
    """Which program a container or compose service runs."""
    if command[:1] == ["llm-coordinator"]:
        return "coordinator"
    if command[:1] == ["llm-worker"]:
        return "worker"
    if command[:3] == ["python", "-m", "worker.provision"]:
        return "provision"
    raise AssertionError(f"unknown command {command}")
