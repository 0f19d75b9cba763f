"""One line of a batch: reading it from the input file, and the line written for it in the output or
error file.

Owns: reading each input line (`{custom_id, method, url, body}`, JSON, one object a line) into a
`Line` to run, or the `LineError` that line gets instead of an answer (a line that is not such an
object, a `custom_id` missing or given twice, a method other than POST, a url other than the batch's
endpoint, a streamed body); each line's id (stable, so a line run again after a restart keeps it); and
the output and error lines in OpenAI's shapes (protocol/batches.py).
Must not: run a line (runner.py) or store one (store.py).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

from protocol.batches import LineError, LineResponse, OutputLine

MAX_CUSTOM_ID = 512


@dataclass(frozen=True, slots=True)
class Line:
    """A line to run: its place in the file, its `custom_id`, and the body to send to the endpoint."""

    index: int
    custom_id: str
    body: bytes


@dataclass(frozen=True, slots=True)
class Refused:
    """A line that gets no answer: its place, its `custom_id` where it had one, and why."""

    index: int
    custom_id: str | None
    error: LineError


def read(data: bytes, endpoint: str) -> list[Line | Refused]:
    """Every non-blank line of an input file, in order, as a `Line` to run or a `Refused` one."""
    seen: set[str] = set()
    out: list[Line | Refused] = []
    for index, raw in enumerate(line for line in data.split(b"\n") if line.strip()):
        read_line = one(index, raw, endpoint)
        custom_id = read_line.custom_id
        if isinstance(read_line, Line) and custom_id in seen:
            read_line = Refused(index, custom_id, LineError(
                code="duplicate_custom_id", message=f"custom_id {custom_id!r} is given by an earlier line; each "
                "line's must be unique in the file"))
        if custom_id is not None:
            seen.add(custom_id)
        out.append(read_line)
    return out


def count(data: bytes) -> int:
    """The lines a file holds (blank ones left out), as `read` would find them."""
    return sum(1 for line in data.split(b"\n") if line.strip())


def one(index: int, raw: bytes, endpoint: str) -> Line | Refused:
    try:
        item = json.loads(raw)
    except ValueError as exc:
        return Refused(index, None, LineError(code="invalid_json_line", message=f"line {index + 1} is not JSON: {exc}"))
    if not isinstance(item, dict):
        return Refused(index, None, LineError(code="invalid_json_line",
                                              message=f"line {index + 1} is not a JSON object"))
    custom_id = item.get("custom_id")
    if not isinstance(custom_id, str) or not 0 < len(custom_id) <= MAX_CUSTOM_ID:
        return Refused(index, None, LineError(code="missing_custom_id", message=f"line {index + 1}: custom_id must "
                                              f"be a string of 1 to {MAX_CUSTOM_ID} characters"))
    problem = _problem(item, endpoint)
    if problem is not None:
        return Refused(index, custom_id, problem)
    return Line(index, custom_id, json.dumps(item["body"]).encode())


def _problem(item: dict[str, Any], endpoint: str) -> LineError | None:
    if str(item.get("method", "")).upper() != "POST":
        return LineError(code="invalid_method", message=f"method {item.get('method')!r}: only POST is run")
    if item.get("url") != endpoint:
        return LineError(code="invalid_url", message=f"url {item.get('url')!r}: this batch runs {endpoint} only "
                         "(every line's url must be the batch's endpoint)")
    body = item.get("body")
    if not isinstance(body, dict):
        return LineError(code="invalid_body", message="body must be a JSON object")
    if body.get("stream"):
        return LineError(code="invalid_body", message="body.stream: a batch answers whole; leave stream out")
    return None


def line_id(batch_id: str, index: int) -> str:
    """The id of line `index` of `batch_id`: the same every time it is asked (also its request's id)."""
    return "batch_req_" + hashlib.sha256(f"{batch_id}:{index}".encode()).hexdigest()[:32]


def answered(batch_id: str, index: int, custom_id: str | None, status: int, body: dict[str, Any]) -> OutputLine:
    """The line for what the endpoint answered (an answer for the output file, a refusal for the error file)."""
    rid = line_id(batch_id, index)
    return OutputLine(id=rid, custom_id=custom_id,
                      response=LineResponse(status_code=status, request_id=rid, body=body))


def unanswered(batch_id: str, refused: Refused) -> OutputLine:
    """The error file's line for a line that got no answer."""
    return OutputLine(id=line_id(batch_id, refused.index), custom_id=refused.custom_id, error=refused.error)
