"""The slots a worker serves its models in (`WORKER_MAX_MODELS`, issue 37), as HTTP reaches them: with more
than one, each model loaded at once is a worker of its own to coordinators, with its own id and URL, on
one process.

Owns: the app's slots (`app.state.slots`, each a worker/slots/slot.py `Slot`: slot 0 is the worker itself, at its own id and URL; slot k is `<id>.m<k>` at
`<url>/slots/<k>`, `WorkerSettings.for_slot`), the slot a request is for (`slot_of`), and `SlotPaths`,
which routes `<url>/slots/<k>/...` to the same routes as `<url>/...`, for slot k. So every route a
coordinator uses (generate, embed, sessions and their KV, prefixes, tokenize, health, loads) needs no
model in its request: the URL names the slot, as it names a worker.
Must not: decide what is loaded in which slot, or change a slot (worker/slots/), or serve a route (routes.py).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from fastapi import FastAPI, Request

from worker.runtime import WorkerRuntime
from worker.settings import SLOTS_PATH
from worker.slots.slot import Slot

SLOT_KEY = "llm_pool.slot"  # the ASGI scope's key for the slot a request is for (SlotPaths)
Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]


def slots_of(app: FastAPI) -> list[Slot]:
    slots: list[Slot] = app.state.slots
    return slots


def slot_of(request: Request) -> Slot:
    """The slot the request's URL names (`SlotPaths`): slot 0 unless it came in under `/slots/<k>`."""
    return slots_of(request.app)[request.scope.get(SLOT_KEY, 0)]


def loaded(app: FastAPI) -> list[WorkerRuntime]:
    """The runtimes of the models served now, in slot order."""
    return [slot.runtime for slot in slots_of(app) if slot.runtime is not None]


class SlotPaths:
    """ASGI: a request to `/slots/<k>/<rest>` (0 < k < `count`) is served by the route of `/<rest>`, for
    slot k (`SLOT_KEY` in its scope). Any other path is left alone (an unknown slot: 404, as any path)."""

    def __init__(self, app: App, count: int) -> None:
        self.app, self._count = app, count

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "") if scope["type"] == "http" else ""
        if path.startswith(SLOTS_PATH + "/"):
            head, _, rest = path[len(SLOTS_PATH) + 1:].partition("/")
            if head.isascii() and head.isdigit() and len(head) == 1 and 0 < int(head) < self._count:
                scope = {**scope, "path": "/" + rest, "raw_path": ("/" + rest).encode(), SLOT_KEY: int(head)}
        await self.app(scope, receive, send)
