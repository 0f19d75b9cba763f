"""OpenAI's Files API, for batches: `POST /v1/files` (multipart, `purpose` `batch`), `GET /v1/files`,
`GET /v1/files/{id}`, `GET /v1/files/{id}/content`, `DELETE /v1/files/{id}`.

Owns: reading the upload's multipart form (`file` and `purpose`; the body bounded by the settings'
`BATCH_FILE_MAX_BYTES` at the edge and here), and these routes as thin adapters onto the batch store
(coordinator/batches/store.py), which keeps each tenant's files apart (another tenant's id is 404) and
refuses a file past a bound by its name. Errors take OpenAI's shape (the app's handler, under /v1/).
Must not: run batches (coordinator/batches/runner.py) or read another tenant's files.
"""

from __future__ import annotations

import asyncio
from email.message import EmailMessage
from email.parser import BytesParser
from email.policy import HTTP
from typing import TypeVar

from fastapi import APIRouter, Request
from fastapi.responses import Response

from coordinator.auth import tenant_of
from coordinator.batches.store import Store, not_found
from coordinator.errors import CoordinatorError
from coordinator.state import CoordinatorState
from coordinator.validate import read_body
from protocol import batches as wire
from protocol import openai as oa
from protocol import reasons

PATH = "/v1/files"
T = TypeVar("T")
UPLOAD_OVERHEAD = 64 * 1024  # bytes of a multipart form around its file: boundaries, headers, `purpose`
MAX_FILENAME = 256
router = APIRouter()


def refusals(what: str) -> dict[int | str, dict[str, object]]:
    """The refusals of a files or batches route, documented: `what` it is refused for."""
    return {"4XX": {"model": oa.ErrorResponse, "description": f"`invalid_request` ({what}), `unauthorized`"}}


_REFUSALS = refusals("a bound passed, by name; 404: no such file of this key's tenant")


def store_of(request: Request) -> Store:
    store: Store = request.app.state.batch_store
    return store


def tenant(request: Request) -> str:
    return tenant_of(request.scope.get("state", {}))


def found(value: T | None, kind: str, given: str) -> T:
    """`value`, or 404 naming the `kind` of thing with id `given` the tenant has none of."""
    if value is None:
        raise not_found(kind, given)
    return value


def now(request: Request) -> int:
    state: CoordinatorState = request.app.state.coordinator
    return int(state.clock.time())


_UPLOAD = {"requestBody": {"required": True, "content": {"multipart/form-data": {"schema": {
    "type": "object", "required": ["file", "purpose"],
    "properties": {"file": {"type": "string", "format": "binary", "description": "JSONL: one "
                            "{custom_id, method, url, body} a line"},
                   "purpose": {"type": "string", "enum": [wire.BATCH]}}}}}}}


@router.post(PATH, summary="Upload a file (OpenAI's API): a batch's input, JSONL", responses=_REFUSALS,
             openapi_extra=_UPLOAD)
async def upload(request: Request) -> wire.FileObject:
    store = store_of(request)
    raw = await read_body(request, store.bounds.file_bytes + UPLOAD_OVERHEAD)
    purpose, filename, data = await asyncio.to_thread(form, request.headers.get("content-type", ""), raw)
    if purpose != wire.BATCH:
        raise CoordinatorError(reasons.INVALID_REQUEST, f"purpose: {purpose!r}; this pool keeps files for "
                               "'batch' only", param="purpose")
    return await store.call(store.add_file, tenant(request), filename, purpose, data, now(request))


@router.get(PATH, summary="The files of this key's tenant, newest first", responses=_REFUSALS)
async def listed(request: Request, purpose: str | None = None, after: str | None = None,
                 limit: str | None = None) -> wire.FileList:
    store = store_of(request)
    return await store.call(store.files, tenant(request), purpose, after, limit_of(limit, 10_000, 10_000))


@router.get(PATH + "/{file_id}", summary="A file's description", responses=_REFUSALS)
async def described(file_id: str, request: Request) -> wire.FileObject:
    store = store_of(request)
    return found(await store.call(store.file, tenant(request), file_id), "file", file_id)


@router.get(PATH + "/{file_id}/content", summary="A file's bytes", response_class=Response, responses=_REFUSALS)
async def content(file_id: str, request: Request) -> Response:
    store = store_of(request)
    data = found(await store.call(store.content, tenant(request), file_id), "file", file_id)
    return Response(data, media_type="application/octet-stream")


@router.delete(PATH + "/{file_id}", summary="Delete a file", responses=_REFUSALS)
async def delete(file_id: str, request: Request) -> wire.FileDeleted:
    store = store_of(request)
    if not await store.call(store.delete_file, tenant(request), file_id):
        raise not_found("file", file_id)
    return wire.FileDeleted(id=file_id, deleted=True)


def limit_of(given: str | None, default: int, most: int) -> int:
    """A list's `limit` query parameter: 1 to `most`; 400 naming it otherwise (in OpenAI's error shape,
    which FastAPI's own 422 is not)."""
    if given is None:
        return default
    if not given.isdigit() or not 1 <= int(given) <= most:
        raise CoordinatorError(reasons.INVALID_REQUEST, f"limit: {given[:20]!r} is not a number from 1 to {most}",
                               param="limit")
    return int(given)


def form(content_type: str, raw: bytes) -> tuple[str, str, bytes]:
    """`purpose`, and the `file` part's name and bytes, of a multipart/form-data body (the standard
    library's MIME parser reads it); 400 naming what is missing."""
    if not content_type.lower().startswith("multipart/form-data"):
        raise CoordinatorError(reasons.INVALID_REQUEST, "the body must be multipart/form-data with `file` and "
                               "`purpose`", param="file")
    message = BytesParser(policy=HTTP).parsebytes(b"Content-Type: " + content_type.encode("latin-1") + b"\r\n\r\n" + raw)
    fields: dict[str, tuple[str | None, bytes]] = {}
    for part in message.iter_parts() if isinstance(message, EmailMessage) else []:
        name = part.get_param("name", header="content-disposition")
        payload = part.get_payload(decode=True)
        if isinstance(name, str) and name not in fields:
            fields[name] = (part.get_filename(), payload if isinstance(payload, bytes) else b"")
    if "file" not in fields:
        raise CoordinatorError(reasons.INVALID_REQUEST, "file: required (the JSONL to upload)", param="file")
    purpose = fields.get("purpose", (None, b""))[1].decode(errors="replace").strip()
    filename, data = fields["file"]
    return purpose, (filename or "upload.jsonl")[:MAX_FILENAME], data
