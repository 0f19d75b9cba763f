"""Wire types of OpenAI's Files and Batches APIs: `/v1/files` and `/v1/batches`.

Owns: the bodies as OpenAI documents them and its SDKs parse them (the `file` and `batch` objects,
their lists, `request_counts`, a batch's `errors`), the endpoints a batch may run and its statuses, and
the shape of one line of a batch's input, output and error files.
Must not: reach workers or know the store; the coordinator's batch surfaces (coordinator/surfaces/files.py,
batches.py) and runner (coordinator/batches/) fill these in.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses")
Endpoint = Literal["/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses"]
# A batch's life: validating -> in_progress -> finalizing -> completed, or failed (its input unusable),
# expired (past its window), cancelling -> cancelled.
VALIDATING, IN_PROGRESS, FINALIZING, COMPLETED = "validating", "in_progress", "finalizing", "completed"
FAILED, EXPIRED, CANCELLING, CANCELLED = "failed", "expired", "cancelling", "cancelled"
RUNNING = (VALIDATING, IN_PROGRESS, FINALIZING, CANCELLING)  # a runner still has work on it
Status = Literal["validating", "in_progress", "finalizing", "completed", "failed", "expired", "cancelling",
                 "cancelled"]
# A file's purpose: `batch` is what a client uploads; the runner writes the other two.
BATCH, BATCH_OUTPUT = "batch", "batch_output"
COMPLETION_WINDOW = "24h"
MAX_METADATA = 16  # pairs, as OpenAI allows


class FileObject(BaseModel):
    id: str
    bytes: int
    created_at: int
    expires_at: int | None = None
    filename: str
    purpose: str
    object: Literal["file"] = "file"
    status: Literal["uploaded", "processed", "error"] = "processed"
    status_details: str | None = None


class Page(BaseModel):
    """What a page of a list has besides its `data`: paged newest first, `after` the page's `last_id`."""

    object: Literal["list"] = "list"
    first_id: str | None = None
    last_id: str | None = None
    has_more: bool = False


class FileList(Page):
    data: list[FileObject]


class FileDeleted(BaseModel):
    id: str
    object: Literal["file"] = "file"
    deleted: bool


class BatchCreate(BaseModel):
    """`POST /v1/batches`; unknown fields are ignored, as on the other OpenAI routes."""

    model_config = ConfigDict(extra="ignore", strict=True)

    input_file_id: str = Field(min_length=1, max_length=128)
    endpoint: Endpoint
    completion_window: Literal["24h"]
    metadata: dict[str, str] | None = Field(default=None, max_length=MAX_METADATA)


class RequestCounts(BaseModel):
    total: int = 0
    completed: int = 0
    failed: int = 0


class LineError(BaseModel):
    """Why a line got no answer at all (a line that could not be read, a url this batch does not run);
    also, with where it was, an error of the batch as a whole (`BatchError`)."""

    code: str
    message: str


class BatchError(LineError):
    param: str | None = None
    line: int | None = None


class BatchErrors(BaseModel):
    object: Literal["list"] = "list"
    data: list[BatchError]


Moment = int | None  # Unix seconds; None: not (yet)


class Moments(BaseModel):
    """When a batch entered each status it went through."""

    in_progress_at: Moment = None
    finalizing_at: Moment = None
    completed_at: Moment = None
    failed_at: Moment = None
    expired_at: Moment = None
    cancelling_at: Moment = None
    cancelled_at: Moment = None


class Batch(Moments):
    id: str
    object: Literal["batch"] = "batch"
    endpoint: str
    errors: BatchErrors | None = None
    input_file_id: str
    completion_window: str = COMPLETION_WINDOW
    status: Status
    output_file_id: str | None = None
    error_file_id: str | None = None
    created_at: int
    expires_at: int | None = None
    request_counts: RequestCounts = RequestCounts()
    metadata: dict[str, str] | None = None


class BatchList(Page):
    data: list[Batch]


class LineResponse(BaseModel):
    """What the endpoint answered one line: its status, the request's id, and its JSON body."""

    status_code: int
    request_id: str
    body: dict[str, Any]


class OutputLine(BaseModel):
    """One line of a batch's output file (an answer) or of its error file (a refusal, or a `LineError`)."""

    id: str
    custom_id: str | None
    response: LineResponse | None = None
    error: LineError | None = None
