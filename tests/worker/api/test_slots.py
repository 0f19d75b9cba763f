"""worker/api/slots.py: `<url>/slots/<k>/...` reaches the same routes as `<url>/...`, for slot k; any other
path (slot 0 itself, a slot past the count, a slot with no route after it) is left alone; and each slot
is a worker of its own, `<id>.m<k>` at `<url>/slots/<k>`."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from fastapi import FastAPI, Request
from fastapi.testclient import TestClient

from worker.api import routes
from worker.api.slots import SlotPaths, slot_of
from worker.errors import WorkerError
from worker.naming import ModelNames
from worker.settings import WorkerSettings
from worker.slots.slot import make_slots


def client(max_models: int) -> TestClient:
    settings = WorkerSettings(worker_id="w", worker_url="http://h:1/", max_models=max_models,
                              model_dir="/m" if max_models > 1 else None)  # type: ignore[arg-type]
    app = FastAPI()
    app.state.slots = make_slots(settings)

    @app.get("/worker/who")
    async def who(request: Request) -> dict[str, object]:
        slot = slot_of(request)
        return {"slot": slot.index, "worker_id": slot.settings.worker_id, "url": slot.settings.worker_url,
                "path": request.url.path}

    app.add_middleware(SlotPaths, count=max_models)
    return TestClient(app)


def test_a_slot_url_reaches_the_same_route_for_that_slot() -> None:
    with client(3) as http:
        assert http.get("/worker/who").json() == {"slot": 0, "worker_id": "w", "url": "http://h:1/",
                                                  "path": "/worker/who"}
        assert http.get("/slots/2/worker/who?x=1").json() == {"slot": 2, "worker_id": "w.m2",
                                                              "url": "http://h:1/slots/2", "path": "/worker/who"}


@pytest.mark.parametrize("path", ["/slots/3/worker/who", "/slots/0/worker/who", "/slots/01/worker/who",
                                  "/slots/1", "/slots/x/worker/who", "/slots//worker/who"])
def test_any_other_slot_path_is_not_found(path: str) -> None:
    with client(3) as http:
        assert http.get(path).status_code == 404


def test_one_slot_has_no_slot_urls() -> None:
    with client(1) as http:
        assert http.get("/slots/1/worker/who").status_code == 404
        assert http.get("/worker/who").json()["worker_id"] == "w"


def test_several_slots_need_a_folder() -> None:
    with pytest.raises(ValueError, match="model-dir"):
        WorkerSettings(max_models=2)


def test_the_workers_own_health_stays_200_while_another_slot_serves_or_beats_in_standby() -> None:
    """Slot 0 emptied by the keep-alive while slot 1's model went to standby: a liveness probe of the
    worker's URL must not see 503 `loading` and restart it; an empty slot past 0 is not found."""
    settings = WorkerSettings(worker_id="w", max_models=3, model_dir="/m")  # type: ignore[arg-type]
    app = FastAPI()
    app.include_router(routes.router)
    app.add_exception_handler(WorkerError, lambda _, exc: exc.to_response(""))  # type: ignore[arg-type, attr-defined]
    app.add_middleware(SlotPaths, count=3)
    app.state.settings, app.state.slots = settings, make_slots(settings)
    with TestClient(app) as http:
        assert http.get("/worker/health").status_code == 503  # nothing loaded yet: still loading
        app.state.slots[1].standby = SimpleNamespace(names=ModelNames("gemma"))
        own, second = http.get("/worker/health"), http.get("/slots/1/worker/health")
        assert (own.status_code, own.json()["status"], own.json()["worker_id"]) == (200, "standby", "w")
        assert (second.status_code, second.json()["model"], second.json()["worker_id"]) == (200, "gemma", "w.m1")
        assert http.get("/slots/2/worker/health").status_code == 404
