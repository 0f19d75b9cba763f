"""worker/api/swap.py's Swapper, with a runtime and a build of its own: one swap at a time, the order
(drain, stop, then load), a model that fails to load refused for a while with its reason while the
model served before comes back, and what cannot be swapped to."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from protocol.worker import MODEL_LOAD_BACKOFF
from worker.api.swap import Swapper
from worker.errors import WorkerError
from worker.metrics import WorkerMetrics
from worker.models.catalog import Offer
from worker.naming import ModelNames
from worker.settings import WorkerSettings

pytestmark = pytest.mark.anyio
OFFERS = [Offer(Path("/m/a.gguf"), "offered", ModelNames("small", ("a",))),
          Offer(Path("/m/b.gguf"), "offered", ModelNames("gemma", ("b",))),
          Offer(Path("/m/c.gguf"), "too_large", ModelNames("big", ("c",)), reason="needs 9 bytes; the budget is 8")]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"  # the worker runs on uvicorn's asyncio loop


class Runtime:
    def __init__(self, name: str, steps: list[str], metrics: WorkerMetrics) -> None:
        self.names, self.jobs, self.metrics, self._steps = ModelNames(name), [], metrics, steps

    async def drain(self, timeout: float) -> None:
        self._steps.append(f"drain {self.names.name} {timeout:g}")

    async def stop(self) -> None:
        self._steps.append(f"stop {self.names.name}")


def swapper(fails: set[str], clock: list[float], lost: list[bool] | None = None) -> tuple[Swapper, Any, list[str]]:
    steps: list[str] = []
    metrics = WorkerMetrics()
    app = SimpleNamespace(state=SimpleNamespace(settings=WorkerSettings(model_path=Path("/m/a.gguf")),
                                                runtime=Runtime("small", steps, metrics)))

    async def build(wanted: WorkerSettings) -> Any:
        await asyncio.sleep(0)
        steps.append(f"load {wanted.model_path.name}")
        if wanted.model_path.name in fails:
            raise RuntimeError("the tensors do not fit")
        return Runtime({"a.gguf": "small", "b.gguf": "gemma"}[wanted.model_path.name], steps, metrics)

    on_lost = (lambda: lost.append(True)) if lost is not None else (lambda: None)
    return Swapper(app, OFFERS, build, clock=lambda: clock[0], on_lost=on_lost), app, steps  # type: ignore[arg-type]


async def test_a_swap_drains_stops_then_loads_and_a_second_ask_joins_it() -> None:
    swap, app, steps = swapper(set(), [0.0])
    assert swap.load("small").state == "loaded"
    assert swap.load("b").model_dump() == {"model": "gemma", "state": "loading"}
    assert swap.load("gemma").state == "loading"  # the same swap
    with pytest.raises(WorkerError) as busy:
        swap.load("small")
    assert (busy.value.status, busy.value.reason) == (409, "model_swapping")
    await swap._task  # type: ignore[misc]
    assert steps == ["drain small 600", "stop small", "load b.gguf"]
    assert app.state.runtime.names.name == "gemma" and app.state.settings.model_path == Path("/m/b.gguf")
    assert swap.load("gemma").state == "loaded" and swap.swapping == ""


async def test_a_model_that_fails_to_load_brings_back_the_one_before_and_is_refused_for_a_while() -> None:
    clock = [0.0]
    swap, app, steps = swapper({"b.gguf"}, clock)
    swap.load("gemma")
    await swap._task  # type: ignore[misc]
    assert steps[-2:] == ["load b.gguf", "load a.gguf"] and app.state.runtime.names.name == "small"
    with pytest.raises(WorkerError) as refused:
        swap.load("gemma")
    assert (refused.value.status, refused.value.reason) == (503, "model_load_failed")
    assert "the tensors do not fit" in refused.value.message
    clock[0] = MODEL_LOAD_BACKOFF
    assert swap.load("gemma").state == "loading"  # tried again after the pause
    await swap._task  # type: ignore[misc]


async def test_a_swap_that_leaves_no_model_stops_the_worker() -> None:
    lost: list[bool] = []
    swap, app, steps = swapper({"a.gguf", "b.gguf"}, [0.0], lost)
    swap.load("gemma")
    await swap._task  # type: ignore[misc]
    assert steps[-2:] == ["load b.gguf", "load a.gguf"] and app.state.runtime is None
    assert lost == [True] and "left no model loaded" in app.state.load_error


@pytest.mark.parametrize(("name", "status", "reason"), [("nowhere", 404, "unknown_model"),
                                                         ("big", 400, "invalid_request")])
async def test_what_the_folder_does_not_offer_is_refused_with_why(name: str, status: int, reason: str) -> None:
    swap, _, steps = swapper(set(), [0.0])
    with pytest.raises(WorkerError) as refused:
        swap.load(name)
    assert (refused.value.status, refused.value.reason) == (status, reason) and steps == []
    if name == "big":
        assert "needs 9 bytes" in refused.value.message
