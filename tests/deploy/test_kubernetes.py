"""deploy/kubernetes: every rendered manifest (base, cpu and gpu overlays) is valid against the
Kubernetes API schemas (offline, `kubernetes-validate`, strict: unknown fields fail), and agrees with
the code: environment names, ports, probe paths, the drain timeout and the scripts it runs."""

from __future__ import annotations

import re
from urllib.parse import urlsplit

import kubernetes_validate
import pytest

from tests.deploy.contract import (
    DOWNWARD_API,
    PROVISION_ENV,
    SHUTDOWN_BESIDES_DRAIN,
    console_scripts,
    default_port,
    drain_timeout,
    env_names,
    get_routes,
    role_of,
)
from tests.deploy.manifests import (
    KUSTOMIZATIONS,
    ROOT,
    Doc,
    container,
    env_of,
    find,
    kubectl_render,
    pod_spec,
    render,
)

# runs kubectl
pytestmark = pytest.mark.process

# The oldest Kubernetes still widely run and the newest the validator knows.
VERSIONS = ["1.29.0", kubernetes_validate.latest_version()]
SECRET = "llm-pool"
SECRET_KEYS = {"WORKER_TOKEN": "worker-token", "API_KEYS": "api-keys"}


def _identity(doc: Doc) -> tuple[str, str]:
    return doc["kind"], doc["metadata"]["name"]


@pytest.fixture(scope="module", params=sorted(KUSTOMIZATIONS))
def rendered(request: pytest.FixtureRequest) -> tuple[str, list[Doc]]:
    return request.param, render(KUSTOMIZATIONS[request.param])


def _containers(docs: list[Doc]) -> list[tuple[Doc, Doc]]:
    """(pod spec, container) for every container, init containers included."""
    return [(spec, c) for doc in docs if doc["kind"] == "Deployment"
            for spec in [doc["spec"]["template"]["spec"]]
            for c in spec.get("initContainers", []) + spec["containers"]]


def test_the_overlays_hold_the_coordinators_their_services_workers_and_budgets(
        rendered: tuple[str, list[Doc]]) -> None:
    _, docs = rendered
    assert sorted(_identity(d) for d in docs) == [
        ("Deployment", "llm-coordinator"), ("Deployment", "llm-worker"),
        ("PodDisruptionBudget", "llm-coordinator"), ("PodDisruptionBudget", "llm-worker"),
        ("Service", "llm-coordinator"), ("Service", "llm-coordinator-peers")]


def test_two_coordinators_and_every_worker_heartbeats_to_each(rendered: tuple[str, list[Doc]]) -> None:
    """No single point of failure: two replicas, at most one disrupted at a time, never both down in
    an update; the workers beat every address of a headless Service, which lists a pod before it is
    ready (a new replica learns the workers while it starts)."""
    docs = rendered[1]
    deployment = find(docs, "Deployment", "llm-coordinator")["spec"]
    assert deployment["replicas"] == 2
    assert deployment["strategy"] == {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}}
    budget = find(docs, "PodDisruptionBudget", "llm-coordinator")["spec"]
    assert budget["maxUnavailable"] == 1
    assert budget["selector"]["matchLabels"].items() <= deployment["template"]["metadata"]["labels"].items()
    env = env_of(container(docs, "llm-worker", "worker"))
    assert env["COORDINATOR_RESOLVE_ALL"]["value"] == "true"
    peers = find(docs, "Service", urlsplit(env["COORDINATOR_URL"]["value"]).hostname or "")["spec"]
    assert peers["clusterIP"] == "None" and peers["publishNotReadyAddresses"] is True


@pytest.mark.parametrize("version", VERSIONS)
def test_every_manifest_is_valid_against_the_kubernetes_schemas(rendered: tuple[str, list[Doc]],
                                                                 version: str) -> None:
    for doc in rendered[1]:
        kubernetes_validate.validate(doc, version, strict=True)


def test_the_schema_check_catches_a_misspelt_field() -> None:
    """The validation above is not vacuous: a field Kubernetes does not know fails it."""
    worker = find(render(KUSTOMIZATIONS["base"]), "Deployment", "llm-worker")
    worker["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {"httpGet": {"path": "/"}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(worker, VERSIONS[-1], strict=True)


@pytest.mark.parametrize("name", sorted(KUSTOMIZATIONS))
def test_these_renderings_are_what_kubectl_renders(name: str) -> None:
    theirs = kubectl_render(KUSTOMIZATIONS[name])
    if theirs is None:
        pytest.skip("kubectl is not installed; the overlays were rendered by tests/deploy/manifests.py only")
    assert {_identity(d): d for d in render(KUSTOMIZATIONS[name])} == {_identity(d): d for d in theirs}


def test_every_env_name_is_a_setting_of_the_service_that_reads_it(rendered: tuple[str, list[Doc]]) -> None:
    for _, c in _containers(rendered[1]):
        role = role_of(c["command"])
        env = env_of(c)
        if role == "provision":
            assert set(env) <= PROVISION_ENV, f"{c['name']}: {set(env) - PROVISION_ENV}"
            continue
        helpers = {name for name in env if name in DOWNWARD_API}
        unknown = set(env) - env_names(role) - helpers
        assert not unknown, f"{rendered[0]}: {c['name']} sets {sorted(unknown)}, which {role} does not read"


def test_the_worker_advertises_its_pod_ip_and_heartbeats_to_the_coordinators_service(
        rendered: tuple[str, list[Doc]]) -> None:
    docs = rendered[1]
    worker = container(docs, "llm-worker", "worker")
    env = env_of(worker)
    names = [e["name"] for e in worker["env"]]
    for helper, field in DOWNWARD_API.items():
        assert env[helper]["valueFrom"] == {"fieldRef": {"fieldPath": field}}
    # Kubernetes expands $(VAR) only from variables defined earlier in the list.
    assert env["WORKER_URL"]["value"] == f"http://$(POD_IP):{default_port('worker')}"
    assert names.index("POD_IP") < names.index("WORKER_URL")
    assert env["WORKER_ID"]["value"] == "$(POD_NAME)" and names.index("POD_NAME") < names.index("WORKER_ID")
    coordinator_url = urlsplit(env["COORDINATOR_URL"]["value"])
    service = find(docs, "Service", coordinator_url.hostname or "")
    assert coordinator_url.port == service["spec"]["ports"][0]["port"]
    deployment = find(docs, "Deployment", "llm-coordinator")
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()


def test_ports_are_the_services_defaults_everywhere(rendered: tuple[str, list[Doc]]) -> None:
    docs = rendered[1]
    for deployment, name, role, port_env in (("llm-coordinator", "coordinator", "coordinator", "PORT"),
                                             ("llm-worker", "worker", "worker", "WORKER_PORT")):
        c = container(docs, deployment, name)
        port = default_port(role)
        assert [p["containerPort"] for p in c["ports"]] == [port]
        assert env_of(c).get(port_env, {"value": str(port)})["value"] == str(port)
        annotations = find(docs, "Deployment", deployment)["spec"]["template"]["metadata"]["annotations"]
        assert annotations["prometheus.io/scrape"] == "true"
        assert annotations["prometheus.io/port"] == str(port)
        assert annotations["prometheus.io/path"] in get_routes(role)
    service_port = find(docs, "Service", "llm-coordinator")["spec"]["ports"][0]
    named = {p["name"]: p["containerPort"] for p in container(docs, "llm-coordinator", "coordinator")["ports"]}
    assert named[service_port["targetPort"]] == default_port("coordinator")


def test_probes_ask_routes_the_apps_serve(rendered: tuple[str, list[Doc]]) -> None:
    for _, c in _containers(rendered[1]):
        role = role_of(c["command"])
        if role == "provision":
            continue
        probes = [c[kind] for kind in ("startupProbe", "readinessProbe", "livenessProbe") if kind in c]
        assert {"readinessProbe", "livenessProbe"} <= set(c), f"{c['name']} lacks readiness or liveness"
        named = {p["name"]: p["containerPort"] for p in c["ports"]}
        for probe in probes:
            assert probe["httpGet"]["path"] in get_routes(role), probe
            assert named[probe["httpGet"]["port"]] == default_port(role)
    worker = container(rendered[1], "llm-worker", "worker")
    assert worker["readinessProbe"]["httpGet"]["path"] == "/worker/health"


def test_probe_paths_answer_on_real_apps() -> None:
    """The probe paths are not only declared: a coordinator and a (simulated) worker answer 200 there."""
    from fastapi.testclient import TestClient

    from coordinator.app import create_app as coordinator_app
    from coordinator.settings import Settings
    from tests.polling import wait_until
    from worker.api.app import create_app as worker_app
    from worker.settings import WorkerSettings

    base = render(KUSTOMIZATIONS["base"])
    paths = {role: {c[kind]["httpGet"]["path"] for _, c in _containers(base) if role_of(c["command"]) == role
                    for kind in ("readinessProbe", "livenessProbe")} for role in ("coordinator", "worker")}
    assert "/coordinator/ready" in paths["coordinator"]  # not ready before it knows the pool
    # JOIN_WAIT 0: a pool with no worker is known at once (tests/coordinator/pool/test_readiness.py waits).
    with TestClient(coordinator_app(Settings(join_wait=0))) as client:
        for path in paths["coordinator"]:
            assert client.get(path).status_code == 200, path
    with TestClient(worker_app(WorkerSettings(engine="simulated", coordinator_url=""))) as client:
        for path in paths["worker"]:
            wait_until(lambda path=path: client.get(path).status_code == 200, 10, f"worker {path} 200")


def test_termination_grace_outlasts_the_drain(rendered: tuple[str, list[Doc]]) -> None:
    docs = rendered[1]
    for deployment, name, role in (("llm-coordinator", "coordinator", "coordinator"),
                                   ("llm-worker", "worker", "worker")):
        c = container(docs, deployment, name)
        env = {k: v["value"] for k, v in env_of(c).items() if "value" in v}
        pre_stop = c.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command", [])
        sleep = float(pre_stop[1]) if pre_stop[:1] == ["sleep"] else 0.0
        grace = pod_spec(docs, deployment)["terminationGracePeriodSeconds"]
        needed = sleep + drain_timeout(role, env) + SHUTDOWN_BESIDES_DRAIN
        assert grace > needed, f"{deployment}: {grace} s grace, {needed} s to stop"
        # Health answers 503 while draining: liveness must not give up on a pod within its grace period.
        liveness = c["livenessProbe"]
        assert liveness["periodSeconds"] * liveness["failureThreshold"] > grace, deployment


def test_secrets_come_from_the_secret_never_from_a_literal(rendered: tuple[str, list[Doc]]) -> None:
    docs = rendered[1]
    assert not [d for d in docs if d["kind"] == "Secret"], "a Secret with its value must not be committed"
    uses = set()
    for _, c in _containers(docs):
        for name, entry in env_of(c).items():
            if name in SECRET_KEYS:
                assert entry["valueFrom"]["secretKeyRef"] == {"name": SECRET, "key": SECRET_KEYS[name]}
                uses.add((role_of(c["command"]), name))
    assert uses == {("coordinator", "WORKER_TOKEN"), ("coordinator", "API_KEYS"), ("worker", "WORKER_TOKEN")}
    # docs/deploy.md tells how to create that Secret with exactly these keys.
    doc = (ROOT / "docs" / "deploy.md").read_text()
    create = re.search(r"kubectl (?:-n \S+ )?create secret generic (\S+)(.*?)\n\s*\n", doc, re.DOTALL)
    assert create and create.group(1) == SECRET
    assert all(f"--from-literal={key}=" in create.group(2) for key in SECRET_KEYS.values())


def test_every_container_has_requests_and_limits_and_runs_unprivileged(rendered: tuple[str, list[Doc]]) -> None:
    for spec, c in _containers(rendered[1]):
        for bound in ("requests", "limits"):
            assert {"cpu", "memory"} <= set(c["resources"][bound]), f"{c['name']}: {bound}"
        assert spec["securityContext"]["runAsNonRoot"] is True
        assert c["securityContext"]["allowPrivilegeEscalation"] is False
        assert console_scripts() >= {c["command"][0]} or c["command"][0] == "python"
        # Service links would add variables such as LLM_COORDINATOR_PORT=tcp://... to the environment
        # both services read their settings from.
        assert spec["enableServiceLinks"] is False


def test_the_disruption_budget_covers_the_workers_and_leaves_most_running(rendered: tuple[str, list[Doc]]) -> None:
    docs = rendered[1]
    budget = find(docs, "PodDisruptionBudget", "llm-worker")["spec"]
    workers = find(docs, "Deployment", "llm-worker")["spec"]
    assert budget["selector"]["matchLabels"].items() <= workers["template"]["metadata"]["labels"].items()
    assert 0 < budget["maxUnavailable"] < workers["replicas"]


def test_only_the_gpu_overlay_asks_for_gpus_and_offloads_layers() -> None:
    for name, docs in ((n, render(f)) for n, f in KUSTOMIZATIONS.items()):
        worker = container(docs, "llm-worker", "worker")
        coordinator = container(docs, "llm-coordinator", "coordinator")
        assert "nvidia.com/gpu" not in coordinator["resources"]["limits"]
        if name == "gpu":
            assert worker["resources"]["limits"]["nvidia.com/gpu"] == 1
            assert int(env_of(worker)["N_GPU_LAYERS"]["value"]) > 0
            assert worker["image"].endswith("-cuda") and not coordinator["image"].endswith("-cuda")
        else:
            assert "nvidia.com/gpu" not in worker["resources"]["limits"]
            assert "N_GPU_LAYERS" not in env_of(worker)


def test_the_model_is_provisioned_from_pypi_into_the_path_the_worker_reads() -> None:
    docs = render(KUSTOMIZATIONS["base"])
    provision = container(docs, "llm-worker", "model", init=True)
    worker = container(docs, "llm-worker", "worker")
    target = provision["command"][provision["command"].index("--target") + 1]
    assert env_of(worker)["MODEL_PATH"]["value"] == target
    mounts = {m["name"]: m for m in worker["volumeMounts"]}
    assert target.startswith(mounts["models"]["mountPath"] + "/") and mounts["models"]["readOnly"] is True
    assert {m["name"] for m in provision["volumeMounts"]} >= {"models"}


def test_what_the_scrape_annotations_promise_holds_on_real_apps() -> None:
    """With the manifests' settings and their Secret's values set, the coordinator's annotated metrics
    path answers a scraper that sends nothing, and a worker's answers only one that sends the worker
    token (the separate scrape job in docs/deploy.md, "Scraping the workers")."""
    from fastapi.testclient import TestClient

    from coordinator.app import create_app as coordinator_app
    from coordinator.settings import Settings
    from worker.api.app import create_app as worker_app
    from worker.settings import WorkerSettings

    base = render(KUSTOMIZATIONS["base"])
    path = {d["metadata"]["name"]: d["spec"]["template"]["metadata"]["annotations"]["prometheus.io/path"]
            for d in base if d["kind"] == "Deployment"}
    env = env_of(container(base, "llm-coordinator", "coordinator"))
    literal = {name: entry["value"] for name, entry in env.items()
               if "value" in entry and name.lower() in Settings.model_fields}
    settings = Settings(**{name.lower(): value for name, value in literal.items()},
                        api_keys="a-client-key", worker_token="the-token")
    with TestClient(coordinator_app(settings)) as client:
        assert client.get(path["llm-coordinator"]).status_code == 200
    worker = WorkerSettings(engine="simulated", coordinator_url="", worker_token="the-token")
    with TestClient(worker_app(worker)) as client:
        assert client.get(path["llm-worker"]).status_code == 401
        assert client.get(path["llm-worker"], headers={"authorization": "Bearer the-token"}).status_code == 200
    doc = (ROOT / "docs" / "deploy.md").read_text()
    assert "### Scraping the workers" in doc and "credentials_file:" in doc
