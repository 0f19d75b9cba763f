"""Moving a kept session's KV between workers of the same model: `GET .../kv` exports it as a blob,
`PUT .../kv` imports one as a kept session of this worker; `POST /worker/prefix` gives a peer the
cells of the longest prefix of its prompt held here (worker/admission.py fetches them).

Owns: the two routes (worker token required, as on every route but health), their bounds (at most
`kv_transfers` moves at once, 503 `transfers_full` past them; a blob at most `kv_transfer_max_bytes`,
413 at the edge, and arriving at BODY_RATE after BODY_GRACE, 408 otherwise; each move's wait on the
engine bounded by `request_timeout`), and the table's side of
a move: an exported session is claimed (busy) while its cells are read and given back as it was; an
imported one is admitted like a new kept session (its KV reserved, 503 `kv_full` / `sessions_full`
when there is no room), filled on the engine thread between two steps, and abandoned without a trace
when its cells do not land (400 `kv_refused`, 409 `session_exists`).
Must not: read or write cells itself (the engine does, `EngineBackend.export_cells` / `import_cells`),
or decide where a session should go (the coordinator will).

Why through a blob and not cell by cell: llama.cpp saves and restores a sequence in one call
(`llama_state_seq_get_data` / `_set_data`), so a move is one read between two decode steps on one
side and one write on the other; the blob carries what the other side must check before it writes
(worker/sessions/transfer.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import AbstractContextManager, asynccontextmanager
from typing import Any

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse, Response
from starlette.requests import ClientDisconnect

from protocol import reasons
from protocol.worker import (
    KV_MEDIA_TYPE,
    PREFIX_PATH,
    SESSIONS_PATH,
    TENANT_PATTERN,
    ChatMessage,
    ErrorBody,
    PrefixRequest,
)
from serving import tracing
from worker.api.routes import authorize, runtime_of
from worker.errors import WorkerError
from worker.runtime import WorkerRuntime
from worker.sessions.messages import Message
from worker.sessions.transfer import TransferRefused, pack, unpack

KV_PATH = SESSIONS_PATH + "/{session_id}/kv"
BLOB_TYPE = KV_MEDIA_TYPE
BODY_GRACE = 2.0  # seconds an upload may take to start
BODY_RATE = 8 << 20  # bytes a second an upload must keep up after that (a 256 MiB blob: 34 s at most)

router = APIRouter()
_TENANT = Query("", pattern=TENANT_PATTERN, description="the tenant whose session it is (\"\" without API keys)")
_MOVER = Query("", pattern=r"^[A-Za-z0-9._-]{0,64}$",
               description="who moves the session (a coordinator's id for its moves): while the worker drains, "
                           "the first mover to export a session takes it, and only that mover may export it again "
                           "(its put failed: the receiver was killed mid-move); \"\": anonymous, once")
_REFUSALS: dict[int | str, dict[str, Any]] = {
    400: {"model": ErrorBody, "description": "`invalid_request`: a malformed tenant or body"},
    401: {"model": ErrorBody, "description": "`unauthorized`"},
    503: {"model": ErrorBody, "description": "`loading`, `transfers_full` (WORKER_KV_TRANSFERS moves run), "
                                             "`kv_full` / `sessions_full` (an import with no room)"}}


def _traced(request: Request, name: str, attributes: tracing.Attributes | None = None
            ) -> AbstractContextManager[tracing.Trace]:
    """The route's span, a child of the `traceparent` it came with (the coordinator's move, a peer's
    request), when this worker traces."""
    return tracing.span(getattr(request.app.state, "tracing", None), name, request.headers, attributes)


@asynccontextmanager
async def _moving(runtime: WorkerRuntime) -> AsyncIterator[None]:
    """One of the worker's `kv_transfers` slots, or 503 at once: a move never queues behind others."""
    slots: asyncio.Semaphore = runtime.transfer_slots
    if slots.locked():
        raise WorkerError(reasons.TRANSFERS_FULL,
                          f"this worker moves {runtime.settings.kv_transfers} sessions' KV at once; try again")
    async with slots:
        yield


async def _body_at_rate(request: Request) -> bytes:
    """The blob, as long as it keeps coming at BODY_RATE bytes a second after BODY_GRACE seconds: an
    upload that declares 200 MiB and sends nothing held a transfer slot for the edge's whole 30 s body
    deadline, so two such held every move and peer fetch off the worker (issue 33). One that falls
    behind is cut with 408; one whose client goes away ends quietly (no traceback)."""
    loop = asyncio.get_running_loop()
    started = loop.time()
    chunks: list[bytes] = []
    received = 0
    stream = request.stream().__aiter__()
    while True:
        allowed = started + BODY_GRACE + received / BODY_RATE - loop.time()
        try:
            async with asyncio.timeout(max(0.0, allowed)):
                chunk = await anext(stream)
        except StopAsyncIteration:
            return b"".join(chunks)
        except TimeoutError:
            raise WorkerError(reasons.REQUEST_TIMEOUT, f"the blob came slower than {BODY_RATE >> 20} MiB/s "
                              f"after {BODY_GRACE:g} s ({received:,} bytes in {loop.time() - started:.1f} s); "
                              "its transfer slot is freed") from None
        except ClientDisconnect:
            raise WorkerError(reasons.INVALID_REQUEST, "the client went away before its blob was sent") from None
        chunks.append(chunk)
        received += len(chunk)


@router.get(KV_PATH, response_class=Response, responses={
    200: {"content": {BLOB_TYPE: {}}, "description": "the session's KV blob (worker/sessions/transfer.py)"},
    404: {"model": ErrorBody, "description": "`unknown_session`"},
    409: {"model": ErrorBody, "description": "`session_busy`: it is generating"}, **_REFUSALS})
async def export_kv(session_id: str, request: Request, tenant: str = _TENANT, mover: str = _MOVER) -> Response:
    authorize(request)
    with _traced(request, "kv export") as trace:
        response = await _export(session_id, tenant, mover, runtime_of(request))
        trace.set({"llm_pool.bytes": len(response.body), "llm_pool.tokens": int(response.headers["x-kv-tokens"])})
        return response


async def _export(session_id: str, tenant: str, mover: str, runtime: WorkerRuntime) -> Response:
    runtime.handed_over()
    async with _moving(runtime):
        session = runtime.table.claim(session_id, tenant=tenant)
        try:
            # Every coordinator of the pool moves a draining worker's sessions: the first to ask takes
            # each, and the others hear it is taken (a session copied to two workers would be two). The
            # one that took it may ask again: its put found no receiver (killed mid-move, issue 50).
            taken_by = session.handed_over
            if runtime.gate.draining and taken_by is not None and (not mover or taken_by != mover):
                raise WorkerError(reasons.SESSION_BUSY, f"session {session_id!r} is being moved by another "
                                  "coordinator")
            async with asyncio.timeout(runtime.settings.request_timeout):
                cells = await asyncio.wrap_future(runtime.cells().export_cells(session.seq_id))
            tokens = list(session.tokens)
            messages = [ChatMessage(role=m.role, content=m.content, tool_calls=m.tool_calls, name=m.name)  # type: ignore[arg-type]
                        for m in session.messages]
            session.handed_over = mover if runtime.gate.draining else None
        finally:
            runtime.table.release(session, keep_kv=True)
    blob = pack(runtime.cells().cells_origin(), tokens, messages, cells)
    runtime.metrics.kv_moved("export", "ok", len(blob))
    return Response(blob, media_type=BLOB_TYPE, headers={"x-kv-tokens": str(len(tokens))})


@router.put(KV_PATH, status_code=201, openapi_extra={"requestBody": {"required": True, "content": {BLOB_TYPE: {
                "schema": {"type": "string", "format": "binary"}}}}},
            responses={**_REFUSALS,
                       400: {"model": ErrorBody, "description": "`kv_refused`: another model, KV type or llama.cpp "
                                                                 "build, or a blob cut short or damaged; "
                                                                 "`invalid_request`: a malformed tenant"},
                       408: {"model": ErrorBody, "description": "`request_timeout`: the blob came slower than 8 MiB/s "
                                                                 "after 2 s"},
                       409: {"model": ErrorBody, "description": "`session_exists`: this tenant holds that id here"},
                       413: {"model": ErrorBody, "description": "`body_too_large` (WORKER_KV_TRANSFER_MAX_BYTES)"}})
async def import_kv(session_id: str, request: Request, tenant: str = _TENANT) -> JSONResponse:
    authorize(request)
    with _traced(request, "kv import"):
        return await _import(session_id, tenant, request, runtime_of(request))


async def _import(session_id: str, tenant: str, request: Request, runtime: WorkerRuntime) -> JSONResponse:
    async with _moving(runtime):
        blob = await _body_at_rate(request)
        try:
            header, cells = unpack(blob, runtime.cells().cells_origin(),
                                   max_tokens=runtime.table.limits.session_max_tokens)
        except TransferRefused as exc:
            runtime.metrics.kv_moved("import", "refused", len(blob))
            raise WorkerError(reasons.KV_REFUSED, str(exc)) from None
        if runtime.table.lookup(session_id, tenant=tenant, continuation=False) is not None:
            raise WorkerError(reasons.SESSION_EXISTS, f"session {session_id!r} is already held here")
        admission = runtime.table.admit(session_id, len(header.tokens), tenant=tenant)
        runtime.engine.free(admission.freed_seq_ids)
        session = admission.session
        held = 0
        try:
            async with asyncio.timeout(runtime.settings.request_timeout):
                held = await asyncio.wrap_future(runtime.cells().import_cells(session.seq_id, cells))
        finally:
            if held != len(header.tokens):
                runtime.engine.free([runtime.table.abandon(session)])
        if held != len(header.tokens):
            runtime.metrics.kv_moved("import", "refused", len(blob))
            raise WorkerError(reasons.KV_REFUSED, f"llama.cpp did not take the cells ({held} of "
                              f"{len(header.tokens)} positions); nothing was kept")
        session.tokens = list(header.tokens)
        session.messages = [Message(m.role, m.content, m.tool_calls, m.name) for m in header.messages]
        runtime.table.release(session, keep_kv=True)
    runtime.metrics.kv_moved("import", "ok", len(blob))
    return JSONResponse({"session_id": session_id, "tokens": held, "bytes": len(blob)}, status_code=201)


@router.post(PREFIX_PATH, response_class=Response, responses={
    200: {"content": {BLOB_TYPE: {}}, "description": "the blob of the sequence holding the longest prefix; its "
                                                     "header's `tokens` say what the cells hold"},
    404: {"model": ErrorBody, "description": "`no_prefix`: none as long as `at_least`"}, **_REFUSALS})
async def export_prefix(body: PrefixRequest, request: Request) -> Response:
    """A peer worker's request for the cells of a prompt's prefix (`GenerateRequest.prefix_peer`): the
    sequence here that holds the longest prefix of it for that tenant, read between two decode steps."""
    authorize(request)
    with _traced(request, "prefix export", {"llm_pool.tenant": body.tenant}):
        return await _export_prefix(body, runtime_of(request))


async def _export_prefix(body: PrefixRequest, runtime: WorkerRuntime) -> Response:
    async with _moving(runtime):
        async with asyncio.timeout(runtime.settings.request_timeout):
            found = await asyncio.wrap_future(runtime.prefix_cells().export_prefix(body.tokens, body.tenant,
                                                                                   body.at_least))
    if found is None:
        raise WorkerError(reasons.NO_PREFIX, f"no sequence here holds {body.at_least} tokens of that prefix")
    tokens, cells = found
    blob = pack(runtime.prefix_cells().cells_origin(), tokens, [], cells)
    runtime.metrics.kv_moved("prefix", "ok", len(blob))
    return Response(blob, media_type=BLOB_TYPE, headers={"x-kv-tokens": str(len(tokens))})
