"""OpenAI's Batch API: `POST /v1/batches`, `GET /v1/batches`, `GET /v1/batches/{id}`,
`POST /v1/batches/{id}/cancel`; and how the runner asks a batch's line of its endpoint (`caller`).

Owns: these routes as thin adapters onto the batch store (a key sees only its tenant's batches; another
tenant's id is 404), and the one way a line is answered: the endpoint's own route handler
(surfaces/openai.py, embeddings.py, responses.py), called in-process with the line's body and the
`batch` priority class, as the key that created the batch (its tenant, limits and budget), so the line
is parsed, refused, admitted, queued, charged and relayed exactly as that route's request would be; its
whole answer is kept (status and JSON body). A line refused for capacity (503) or a key's rate (429
`rate_limited`) is to be asked again (`Answer.retry`); any other refusal is that line's answer.
Must not: run jobs (coordinator/batches/runner.py) or call the coordinator over the network.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import Response
from pydantic import ValidationError
from starlette.types import Message

from coordinator.admission import priority
from coordinator.auth import CLIENT, TENANT, client_of, tenant_of
from coordinator.batches.runner import Answer, Asking, Call, Runner
from coordinator.errors import CoordinatorError
from coordinator.state import CoordinatorState
from coordinator.surfaces import embeddings, openai, responses
from coordinator.surfaces.files import found, limit_of, now, refusals, store_of, tenant
from coordinator.surfaces.infer import json_body
from coordinator.validate import describe, first_field, read_body
from protocol import batches as wire
from protocol import openai as oa
from protocol import reasons
from protocol.openapi import inlined
from protocol.worker import REQUEST_ID_HEADER

log = logging.getLogger("coordinator.batches")
PATH = "/v1/batches"
WINDOW = 24 * 3600  # seconds of the one completion window OpenAI offers, "24h"
MAX_BODY = 64 * 1024
Handler = Callable[[Request], Coroutine[Any, Any, Response]]
HANDLERS: dict[str, Handler] = {openai.CHAT_PATH: openai.chat_completions, openai.COMPLETIONS_PATH: openai.completions,
                                embeddings.PATH: embeddings.create, responses.PATH: responses.create}
assert set(HANDLERS) == set(wire.ENDPOINTS)
router = APIRouter()
_REFUSALS = refusals("404: no such batch or input file of this key's tenant")


def _runner(request: Request) -> Runner:
    runner: Runner = request.app.state.batch_runner
    return runner


@router.post(PATH, summary="Create a batch (OpenAI's API)", responses=_REFUSALS,
             openapi_extra=json_body(inlined(wire.BatchCreate), "`BatchCreate`; unknown fields are ignored"))
async def create(request: Request) -> wire.Batch:
    store = store_of(request)
    try:
        body = wire.BatchCreate.model_validate_json(await read_body(request, MAX_BODY))
    except ValidationError as exc:
        raise CoordinatorError(reasons.INVALID_REQUEST, describe(exc), param=first_field(exc)) from None
    scope_state = request.scope.get("state", {})
    client = client_of(scope_state)
    batch = await store.call(store.create_batch, tenant_of(scope_state), client.key_id if client else None, body,
                             now(request), WINDOW)
    _runner(request).poke()
    return batch


@router.get(PATH, summary="The batches of this key's tenant, newest first", responses=_REFUSALS)
async def listed(request: Request, after: str | None = None, limit: str | None = None) -> wire.BatchList:
    store = store_of(request)
    return await store.call(store.batches, tenant(request), after, limit_of(limit, 20, 100))


@router.get(PATH + "/{batch_id}", summary="A batch, with its status and request_counts", responses=_REFUSALS)
async def described(batch_id: str, request: Request) -> wire.Batch:
    store = store_of(request)
    return found(await store.call(store.batch, tenant(request), batch_id), "batch", batch_id)


@router.post(PATH + "/{batch_id}/cancel", summary="Cancel a batch: its lines running end, the rest do not run",
             responses=_REFUSALS)
async def cancel(batch_id: str, request: Request) -> wire.Batch:
    store = store_of(request)
    cancelled = found(await store.call(store.cancel, tenant(request), batch_id, now(request)), "batch", batch_id)
    _runner(request).poke()
    return cancelled


def caller(app: FastAPI) -> Call:
    """How the runner asks a line of its endpoint: the route's own handler, in-process (see the module's
    docstring)."""

    async def call(asking: Asking) -> Answer | None:
        state: CoordinatorState = app.state.coordinator
        client = state.api_keys.client(asking.key_id) if state.api_keys is not None and asking.key_id else None
        if state.api_keys is not None and client is None:
            return Answer(401, oa.error_body("the API key that created this batch is no longer configured",
                                             status=401, code=reasons.UNAUTHORIZED))
        body = asking.line.body
        scope: dict[str, Any] = {
            "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
            "path": asking.endpoint, "raw_path": asking.endpoint.encode(), "query_string": b"", "root_path": "",
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                        (priority.HEADER.encode(), priority.BATCH.encode()),
                        (REQUEST_ID_HEADER.lower().encode(), asking.request_id.encode())],
            "client": None, "server": None, "app": app, "state": {TENANT: asking.tenant, CLIENT: client}}
        exchange = _Exchange(body, asking.gone)
        try:
            response = await _unless_gone(HANDLERS[asking.endpoint](Request(scope, exchange.receive)), asking.gone)
            if response is None:
                return None
            await response(scope, exchange.receive, exchange.send)  # its supervisor sees the job stop as a leaving
        except Exception:  # a bug, as the app's handler answers it over HTTP: that line's 500, logged
            log.exception(json.dumps({"event": "batch_line_failed", "request_id": asking.request_id}))
            return Answer(500, oa.error_body("internal error", status=500, code=reasons.INTERNAL))
        return exchange.answer()

    return call


async def _unless_gone(opening: Coroutine[Any, Any, Response], gone: asyncio.Event) -> Response | None:
    """The handler's response, or None when the job stopped first (a request still being placed, or
    waiting for its first token, is cancelled: the gateway gives back what it reserved)."""
    handler = asyncio.ensure_future(opening)
    stopped = asyncio.ensure_future(gone.wait())
    try:
        await asyncio.wait((handler, stopped), return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopped.cancel()
        if not handler.done():
            handler.cancel()
        await asyncio.gather(handler, stopped, return_exceptions=True)
    return handler.result() if not handler.cancelled() else None


class _Exchange:
    """One in-process request's two ends: its body given once, then (when the job stops) the client's
    leaving; and its response kept whole."""

    def __init__(self, body: bytes, gone: asyncio.Event) -> None:
        self._body: bytes | None = body
        self._gone = gone
        self.status: int | None = None
        self._chunks: list[bytes] = []

    async def receive(self) -> Message:
        if self._body is not None:
            body, self._body = self._body, None
            return {"type": "http.request", "body": body, "more_body": False}
        await self._gone.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self.status = message["status"]
        elif message["type"] == "http.response.body":
            self._chunks.append(message.get("body", b""))

    def answer(self) -> Answer | None:
        if self.status is None:
            return None  # it ended without a response: its job stopped
        raw = b"".join(self._chunks)
        try:
            body = json.loads(raw)
        except ValueError:
            body = None
        if not isinstance(body, dict):
            body = {"error": {"message": raw[:1000].decode(errors="replace"), "type": "server_error", "code": None}}
        code = (body.get("error") or {}).get("code") if isinstance(body.get("error"), dict) else None
        retry = self.status == 503 or (self.status == 429 and code == reasons.RATE_LIMITED)
        return Answer(self.status, body, retry)
