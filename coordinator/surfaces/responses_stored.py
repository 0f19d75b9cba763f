"""Stored Responses: `store: true` (OpenAI's default), `previous_response_id` over HTTP, and
`GET`/`DELETE /v1/responses/{id}` with `GET /v1/responses/{id}/input_items`.

Owns: a turn's preparation (`prepare`: the stored conversation of `previous_response_id` put before
the new input, and the worker that ran it preferred, so the turn runs where that conversation's KV
is and prefills only what is new; an unknown or another tenant's id: 400 `previous_response_not_found`, as
OpenAI answers it), the record a finished response leaves (`Record`: the response, its conversation
as input items with its output after them, its own input), written before the client can
read the response's end (`Settling`: the record is kept, then the final bytes go out), and the three
read/delete routes in OpenAI's shapes. A response is stored only when it completed or is incomplete
(a failed one has nothing to continue), and only up to RESPONSES_RECORD_BYTES.
Must not: find or call workers (state.stored does, coordinator/pool/records.py), parse the request
(responses.py does, the same for a continued turn as for a new one), or keep anything itself.

Where the records live and why: on the worker that ran the response, next to its KV (worker/api/
records.py): any coordinator finds them, a coordinator's restart loses nothing, and no database is
needed. Its KV is the worker's prompt cache: a finished sequence keeps its tokens until another
request of the same tenant reuses them or needs the room (split KV, WORKER_PROMPT_CACHE), and a turn
that prefers that worker (`Generation.prefer`: first if it passes every filter) has its prompt's
cached prefix reused there or copied from another sequence of its tenant. No kept session: a stored
response holds no sequence and no KV reservation, so `store: true` (the default) costs the pool no
capacity; where the cells have gone meanwhile, the turn is prefilled whole, slower, never wrong.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from starlette.types import Message, Receive, Scope, Send

from coordinator.auth import tenant_of
from coordinator.errors import CoordinatorError
from coordinator.state import CoordinatorState
from coordinator.surfaces.files import limit_of, refusals
from coordinator.validate import request_id_of
from protocol import openai_responses as rs
from protocol import reasons

log = logging.getLogger("coordinator.responses")
FINISHED = frozenset({"completed", "incomplete"})
Items = list[dict[str, Any]]

router = APIRouter()


@dataclass(slots=True)
class Turn:
    """A request made ready to parse: `body` has the whole conversation as its input; `prefer` is the
    worker that ran the response it continues; the rest is what its record will need."""

    body: dict[str, Any]
    previous: str | None
    before: Items  # the stored conversation it continues (empty for a first turn)
    given: Items  # its own input, as items
    store: bool
    prefer: str | None = None  # the worker holding the continued conversation's record (and its KV)
    record: bytes | None = field(default=None)  # set once the response has ended and was worth keeping


async def prepare(state: CoordinatorState, raw: bytes, tenant: str) -> Turn | None:
    """The turn `raw` asks for; None where the body is not a JSON object (the parser says why)."""
    try:
        body = json.loads(raw)
    except ValueError:
        return None
    if not isinstance(body, dict):
        return None
    store = state.settings.responses_store and body.get("store") is not False
    body.pop("store", None)
    previous = body.pop("previous_response_id", None)
    given = body.get("input")
    items = [{"role": "user", "content": given}] if isinstance(given, str) else given
    if not isinstance(items, list):
        return Turn(body, None, [], [], store)  # the parser refuses it, naming `input`
    turn = Turn(body, previous if isinstance(previous, str) else None, [], items, store)
    if previous is not None:
        worker_id, record = await stored(state, tenant, previous)
        turn.before = record.get("items", [])
        body["input"] = [*turn.before, *items]
        turn.prefer = worker_id
    return turn


async def stored(state: CoordinatorState, tenant: str, previous: object) -> tuple[str, dict[str, Any]]:
    """The worker holding `tenant`'s stored response `previous`, and its record; 400
    `previous_response_not_found` where no live worker has it."""
    if not isinstance(previous, str) or not previous:
        raise CoordinatorError(reasons.INVALID_REQUEST, "previous_response_id: give a response's id",
                               param="previous_response_id")
    found = await state.stored.get((tenant, previous)) if _plausible(previous) else None
    if found is None:
        raise CoordinatorError(rs.PREVIOUS_NOT_FOUND, f"Previous response with id {previous!r} not found: it was "
                               "never stored (store: false), or has expired, been deleted or evicted past its "
                               "bounds, or its worker is gone; send the whole conversation as input",
                               status=400, param="previous_response_id")
    record: dict[str, Any] = json.loads(found.body)
    return found.worker_id, record


def _plausible(response_id: str) -> bool:
    return len(response_id) <= 160 and all(c.isalnum() or c in "._:-" for c in response_id)


def finished(turn: Turn, ended: rs.ResponseObject | None, limit: int) -> None:
    """Make the record of a response that has ended, where it is worth keeping (and fits `limit`)."""
    if not turn.store or ended is None or ended.status not in FINISHED:
        return
    output = [item.model_dump(mode="json", exclude_none=True) for item in ended.output]
    body = json.dumps({"response": ended.model_dump(mode="json"), "items": [*turn.before, *turn.given, *output],
                       "input": turn.given}, separators=(",", ":")).encode()
    if len(body) > limit:
        log.warning(json.dumps({"event": "response_not_stored", "response_id": ended.id, "bytes": len(body),
                                "limit": limit}))
        return
    turn.record = body


async def keep(state: CoordinatorState, turn: Turn, worker_id: str, tenant: str, response_id: str) -> None:
    """Write the record, if any, to the worker that ran the response; a failure is logged (the
    response was answered; a turn continuing it will hear previous_response_not_found)."""
    if turn.record is None:
        return
    if not await state.stored.put(worker_id, (tenant, response_id), turn.record):
        log.warning(json.dumps({"event": "response_not_stored", "response_id": response_id, "worker_id": worker_id}))


class Settling(Response):
    """`inner`, whose first bytes after `ready()` turns true (the response's end, encoded) wait for
    `settle()` (its record kept): a client that has read a response's end can continue it at once,
    through any coordinator."""

    def __init__(self, inner: Response, ready: Callable[[], bool], settle: Callable[[], Awaitable[None]]) -> None:
        super().__init__()
        self.inner = inner
        self.ready = ready
        self.settle = settle
        self._settled = False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def settling(message: Message) -> None:
            if not self._settled and self.ready():
                self._settled = True
                await self.settle()
            await send(message)

        await self.inner(scope, receive, settling)


async def _record(request: Request, response_id: str) -> dict[str, Any]:
    state: CoordinatorState = request.app.state.coordinator
    tenant = tenant_of(request.scope.get("state", {}))
    found = await state.stored.get((tenant, response_id)) if _plausible(response_id) else None
    if found is None:
        raise CoordinatorError(reasons.UNKNOWN_RESPONSE, f"Response with id {response_id!r} not found.",
                               param="response_id")
    record: dict[str, Any] = json.loads(found.body)
    return record


_REFUSALS = refusals("a malformed list parameter, by name; 404 `unknown_response`: no such stored response of "
                     "this key's tenant")


@router.get("/v1/responses/{response_id}", summary="A stored response", response_model=rs.ResponseObject,
            responses=_REFUSALS)
async def retrieve(response_id: str, request: Request) -> JSONResponse:
    request_id_of(request)
    return JSONResponse((await _record(request, response_id))["response"])


@router.delete("/v1/responses/{response_id}", summary="Delete a stored response", responses=_REFUSALS)
async def delete(response_id: str, request: Request) -> JSONResponse:
    state: CoordinatorState = request.app.state.coordinator
    tenant = tenant_of(request.scope.get("state", {}))
    if not (_plausible(response_id) and await state.stored.delete((tenant, response_id))):
        raise CoordinatorError(reasons.UNKNOWN_RESPONSE, f"Response with id {response_id!r} not found.",
                               param="response_id")
    return JSONResponse({"id": response_id, "object": "response", "deleted": True})


@router.get("/v1/responses/{response_id}/input_items", summary="A stored response's input items",
            responses=_REFUSALS)
async def input_items(response_id: str, request: Request, limit: str | None = None, order: str | None = None,
                      after: str | None = None) -> JSONResponse:
    """`limit` 1 to 100 (20), `order` `desc` (the default, as OpenAI's) or `asc`, `after` an item id."""
    most = limit_of(limit, 20, 100)
    if order not in (None, "asc", "desc"):
        raise CoordinatorError(reasons.INVALID_REQUEST, f"order: {order[:20]!r} is not asc or desc", param="order")
    record = await _record(request, response_id)
    items = [_listed(item, response_id, i) for i, item in enumerate(record.get("input", []))]
    if order != "asc":
        items.reverse()
    if after is not None:
        ids = [item["id"] for item in items]
        items = items[ids.index(after) + 1:] if after in ids else []
    page = items[:most]
    return JSONResponse({"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                         "last_id": page[-1]["id"] if page else None, "has_more": len(items) > most})


def _listed(item: dict[str, Any], response_id: str, index: int) -> dict[str, Any]:
    """An input item as OpenAI lists it: with an id, and a message's content as typed parts."""
    listed = dict(item)
    listed.setdefault("id", f"item_{response_id.removeprefix(rs.RESPONSE_ID_PREFIX)}_{index}")
    if listed.get("type", rs.INPUT_ITEM_TYPE) == rs.INPUT_ITEM_TYPE:
        listed["type"] = rs.INPUT_ITEM_TYPE
        listed.setdefault("status", "completed")
        content = listed.get("content")
        if isinstance(content, str):
            kind = "output_text" if listed.get("role") == "assistant" else "input_text"
            listed["content"] = [{"type": kind, "text": content}]
    return listed
