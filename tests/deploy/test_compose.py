"""deploy/compose.yaml: a coordinator and five workers that find it, every env name one the service
reads, ports and health checks the code serves, stop grace longer than the drain."""

from __future__ import annotations

import re
import shutil
import subprocess
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from tests.deploy.contract import (
    PROVISION_ENV,
    SHUTDOWN_BESIDES_DRAIN,
    default_port,
    drain_timeout,
    env_names,
    get_routes,
    role_of,
)
from tests.deploy.manifests import DEPLOY, ROOT

COMPOSE = DEPLOY / "compose.yaml"


@pytest.fixture(scope="module")
def services() -> dict[str, dict[str, Any]]:
    loaded: dict[str, Any] = yaml.safe_load(COMPOSE.read_text())  # merge keys (<<) resolved here
    return {name: service for name, service in loaded["services"].items()}


def _env(service: dict[str, Any]) -> dict[str, str]:
    return {k: str(v) for k, v in service.get("environment", {}).items()}


def _by_role(services: dict[str, dict[str, Any]], role: str) -> dict[str, dict[str, Any]]:
    return {name: s for name, s in services.items() if role_of(s["command"]) == role}


def test_a_coordinator_five_workers_and_a_model_step(services: dict[str, dict[str, Any]]) -> None:
    assert list(_by_role(services, "coordinator")) == ["coordinator"]
    assert len(_by_role(services, "worker")) == 5
    assert list(_by_role(services, "provision")) == ["model"]
    assert {s["image"] for s in services.values()} == {"llm-pool:0.1.0"}
    assert {s["build"]["context"] for s in services.values()} == {".."}
    assert (COMPOSE.parent / ".." / "Dockerfile").resolve() == ROOT / "Dockerfile"


def test_every_env_name_is_a_setting_of_the_service_that_reads_it(services: dict[str, dict[str, Any]]) -> None:
    for name, service in services.items():
        role = role_of(service["command"])
        allowed = PROVISION_ENV if role == "provision" else env_names(role)
        unknown = set(_env(service)) - allowed
        assert not unknown, f"{name} sets {sorted(unknown)}, which {role} does not read"


def test_each_worker_advertises_its_own_name_and_finds_the_coordinator(services: dict[str, dict[str, Any]]) -> None:
    coordinator_port = default_port("coordinator")
    assert _env(services["coordinator"]).get("PORT", str(coordinator_port)) == str(coordinator_port)
    assert services["coordinator"]["ports"] == [f"${{PORT:-{coordinator_port}}}:{coordinator_port}"]
    ids = set()
    for name, worker in _by_role(services, "worker").items():
        env = _env(worker)
        advertised = urlsplit(env["WORKER_URL"])
        assert advertised.hostname == name, "the coordinator reaches a worker by its service name"
        assert advertised.port == int(env.get("WORKER_PORT", default_port("worker"))) == default_port("worker")
        assert urlsplit(env["COORDINATOR_URL"]) == urlsplit(f"http://coordinator:{coordinator_port}")
        assert env["WORKER_TOKEN"] == _env(services["coordinator"])["WORKER_TOKEN"] == "${WORKER_TOKEN:-}"
        ids.add(env["WORKER_ID"])
        assert worker["depends_on"]["model"] == {"condition": "service_completed_successfully"}
        assert "models:/models:ro" in worker["volumes"]
    assert len(ids) == 5


def test_the_model_lands_where_the_workers_read_it(services: dict[str, dict[str, Any]]) -> None:
    from worker.provision import DEFAULT_MODEL

    command = services["model"]["command"]
    target = command[command.index("--target") + 1]
    assert target == f"/models/{DEFAULT_MODEL.filename}"
    # The workers' MODEL_PATH is the image's (Dockerfile ENV), which must be the same file.
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert re.search(rf"MODEL_PATH={re.escape(target)}\b", dockerfile)


def test_health_checks_ask_routes_the_apps_serve(services: dict[str, dict[str, Any]]) -> None:
    for name, service in services.items():
        role = role_of(service["command"])
        if role == "provision":
            assert "healthcheck" not in service
            continue
        urls = re.findall(r"http://127\.0\.0\.1:(\d+)(/[\w/]+)", " ".join(service["healthcheck"]["test"]))
        assert urls, f"{name}: no health check URL"
        for port, path in urls:
            assert int(port) == default_port(role) and path in get_routes(role), f"{name}: {port}{path}"


def test_stop_grace_outlasts_the_drain(services: dict[str, dict[str, Any]]) -> None:
    for name, service in services.items():
        role = role_of(service["command"])
        if role == "provision":
            continue
        grace = re.fullmatch(r"(\d+)s", service["stop_grace_period"])
        assert grace, service["stop_grace_period"]
        assert int(grace.group(1)) > drain_timeout(role, _env(service)) + SHUTDOWN_BESIDES_DRAIN, name


def test_docker_compose_accepts_the_file() -> None:
    compose = shutil.which("docker-compose")
    if compose is None:
        pytest.skip("docker-compose is not installed; the file was checked by the tests above only")
    done = subprocess.run([compose, "-f", str(COMPOSE), "config", "--quiet"], check=False, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
