"""A jobs file, read into validated jobs before anything is sent.

Owns: the two file formats, the per-job request body, and the key a job is known by in the results
(its `id` when the file gives one, else its index among the jobs).
Must not: do network I/O, or know about the results file.

Formats:
- text: one prompt per line; blank lines are skipped. Every job gets the command line's defaults.
- JSONL: one JSON object per line: `prompt` (sent to `/coordinator/infer`) or `messages` (a chat,
  sent to `/v1/chat/completions`), an optional `id` (a string or number, unique in the file), and any
  request field of that surface (`max_tokens`, `temperature`, `model`, `seed`, `stop`, ...), which win
  over the command line's defaults.
`auto` picks JSONL when the first non-blank line starts with `{`.

Every line is checked against the public request types (`protocol.inference.InferRequest`,
`protocol.openai.ChatCompletionRequest`) here, so a bad line is reported with its line number before
the first request, not as a 400 halfway through a batch. All problems are reported at once.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any, Literal

from pydantic import ValidationError

from protocol.inference import InferRequest
from protocol.openai import ChatCompletionRequest

INFER_PATH = "/coordinator/infer"
CHAT_PATH = "/v1/chat/completions"
# Fields the client sets itself on a chat request, so a job may not.
_CHAT_RESERVED = {"stream", "stream_options", "n"}
_CHAT_FIELDS = set(ChatCompletionRequest.model_fields) - _CHAT_RESERVED
MAX_PROBLEMS_SHOWN = 20

Format = Literal["auto", "text", "jsonl"]


class Surface(str, Enum):
    """Which public route a job goes to: a prompt to the pool's own API, messages to the chat API."""

    INFER = INFER_PATH
    CHAT = CHAT_PATH


@dataclass(frozen=True)
class Defaults:
    """Request fields from the command line, for jobs that do not set them."""

    max_tokens: int | None = None
    temperature: float | None = None
    model: str | None = None

    def fields(self) -> dict[str, Any]:
        return {k: v for k, v in (("max_tokens", self.max_tokens), ("temperature", self.temperature),
                                  ("model", self.model)) if v is not None}


@dataclass(frozen=True)
class Job:
    index: int  # 0-based position among the jobs
    line: int  # 1-based line number in the jobs file
    id: str | None
    surface: Surface
    body: dict[str, Any] = field(repr=False)  # the validated request body, only the fields set

    @property
    def key(self) -> str:
        return key_of(self.id, self.index)

    @property
    def prompt(self) -> str | None:
        return self.body.get("prompt")

    @property
    def messages(self) -> list[dict[str, Any]] | None:
        return self.body.get("messages")


def key_of(job_id: str | None, index: int) -> str:
    """What a job is known by in the results: its id, else its index (the two never collide)."""
    return f"id:{job_id}" if job_id is not None else f"index:{index}"


@dataclass(frozen=True)
class Problem:
    line: int
    message: str


class _BadLine(Exception):
    """One line's problem; collected into a `JobFileError` with the others."""


class JobFileError(ValueError):
    """The jobs file has lines that cannot be sent; `problems` holds every one with its line number."""

    def __init__(self, source: str, problems: list[Problem]) -> None:
        self.source = source
        self.problems = problems
        shown = [f"{source}:{p.line}: {p.message}" for p in problems[:MAX_PROBLEMS_SHOWN]]
        if len(problems) > MAX_PROBLEMS_SHOWN:
            shown.append(f"... and {len(problems) - MAX_PROBLEMS_SHOWN} more")
        super().__init__("\n".join(shown))


def read_jobs(path: Path, defaults: Defaults = Defaults(), fmt: Format = "auto") -> list[Job]:
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise JobFileError(str(path), [Problem(1, f"not UTF-8 text ({exc.reason} at byte {exc.start})")]) from None
    return parse_jobs(text, defaults, fmt, source=str(path))


def parse_jobs(text: str, defaults: Defaults = Defaults(), fmt: Format = "auto",
               source: str = "<jobs>") -> list[Job]:
    lines = [(n, line) for n, line in enumerate(text.splitlines(), start=1) if line.strip()]
    if fmt == "auto":
        fmt = "jsonl" if lines and lines[0][1].lstrip().startswith("{") else "text"
    jobs: list[Job] = []
    problems: list[Problem] = []
    seen_ids: dict[str, int] = {}
    for n, line in lines:
        try:
            job_id, surface, body = _text_job(line, defaults) if fmt == "text" else _json_job(line, defaults)
        except _BadLine as exc:
            problems.append(Problem(n, str(exc)))
            continue
        if job_id is not None:
            if job_id in seen_ids:
                problems.append(Problem(n, f"id {job_id!r} is already used on line {seen_ids[job_id]}"))
                continue
            seen_ids[job_id] = n
        jobs.append(Job(len(jobs), n, job_id, surface, body))
    if problems:
        raise JobFileError(source, problems)
    if not jobs:
        raise JobFileError(source, [Problem(1, "no jobs: the file has no non-blank line")])
    return jobs


def _text_job(line: str, defaults: Defaults) -> tuple[None, Surface, dict[str, Any]]:
    return None, Surface.INFER, _validated_infer({**defaults.fields(), "prompt": line})


def _json_job(line: str, defaults: Defaults) -> tuple[str | None, Surface, dict[str, Any]]:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        raise _BadLine(f"not valid JSON ({exc.msg} at column {exc.colno})") from None
    if not isinstance(obj, dict):
        raise _BadLine(f"expected a JSON object, got {type(obj).__name__}")
    job_id = obj.pop("id", None)
    if job_id is not None:
        if isinstance(job_id, bool) or not isinstance(job_id, str | int):
            raise _BadLine("id: must be a string or an integer")
        job_id = str(job_id)
    fields = {**defaults.fields(), **obj}
    if ("prompt" in obj) == ("messages" in obj):
        raise _BadLine("give exactly one of prompt and messages")
    if "prompt" in obj:
        return job_id, Surface.INFER, _validated_infer(fields)
    return job_id, Surface.CHAT, _validated_chat(fields)


def _validated_infer(fields: dict[str, Any]) -> dict[str, Any]:
    try:
        return InferRequest.model_validate(fields).model_dump(exclude_unset=True)
    except ValidationError as exc:
        raise _BadLine(_describe(exc)) from None


def _validated_chat(fields: dict[str, Any]) -> dict[str, Any]:
    # The chat type ignores unknown fields (as OpenAI's API does); a jobs file is ours, so a typo
    # such as `max_token` is reported instead of silently dropped.
    unknown = sorted(set(fields) - _CHAT_FIELDS)
    if unknown:
        raise _BadLine(f"{', '.join(unknown)}: not a field of a chat job")
    try:
        return ChatCompletionRequest.model_validate(fields).model_dump(exclude_unset=True)
    except ValidationError as exc:
        raise _BadLine(_describe(exc)) from None


def _describe(exc: ValidationError, limit: int = 3) -> str:
    parts = []
    for err in exc.errors()[:limit]:
        where = ".".join(str(p) for p in err["loc"]) or "job"
        parts.append(f"{where}: {err['msg']}")
    return "; ".join(parts)
