"""Tool calls on the chat and Responses routes: what a request offers, and the calls an answer makes.

Owns: reading `tools` and `tool_choice` (each route reads its own shapes into `Tools` with `choose`),
handing them to the worker in the internal request (`offer`: the functions, the choice, `parallel`),
an assistant's earlier calls as internal messages carry them (`called`), and reading calls back out
of the model's answer (out of each choice's, when a request asks for several: each is held and read
on its own).
Must not: write the tools or the conversation's calls into the prompt, or hold the answer to a call:
the worker does both, in its model's tool format (worker/backends/tool_format.py: the model
template's own tool section when it writes `<tool_call>` blocks, else a generic JSON format).

An answer is read as calls in either format, so the reader need not know which model answered: one
JSON object `{"name": ..., "arguments": {...}}` naming one of the tools (with `parallel_tool_calls`,
OpenAI's default, also a JSON list of 1 to MAX_PARALLEL_CALLS of them), or `<tool_call>` blocks each
holding such an object (one block without `parallel_tool_calls`). With `tool_choice` `none` nothing
is read as a call. With `auto` an answer that is anything else is text.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from coordinator.errors import CoordinatorError
from protocol import openai as oa
from protocol import reasons
from protocol.worker import MAX_PARALLEL_CALLS

OPEN_TAG, CLOSE_TAG = "<tool_call>", "</tool_call>"  # the tagged format's call block


@dataclass(frozen=True, slots=True)
class Tools:
    functions: tuple[oa.FunctionDef, ...]
    choice: str  # "none", "auto", "required", or the name of the one function to call
    parallel: bool = True  # several calls in one answer may be made (a JSON list of them)

    @property
    def names(self) -> frozenset[str]:
        return frozenset(f.name for f in self.functions)

    @property
    def calling(self) -> bool:
        """Whether the answer is read for a call (not with `none`)."""
        return self.choice != "none"


def tools_of(body: oa.ChatCompletionRequest) -> Tools | None:
    given = body.tool_choice
    functions = tuple(tool.function for tool in body.tools or ())
    parallel = body.parallel_tool_calls is not False
    if isinstance(given, oa.NamedToolChoice):
        return choose(functions, None, given.function.get("name", ""), parallel=parallel)
    return choose(functions, given, None, parallel=parallel)


def choose(functions: tuple[oa.FunctionDef, ...], mode: str | None, named: str | None, *,
           parallel: bool) -> Tools | None:
    """The request's tools: its functions, and `mode` (`none`, `auto`, `required`; None: auto) or the
    function `named` to call; None without functions (a `tool_choice` other than `none` is then refused)."""
    if not functions:
        if named is not None or mode not in (None, "none"):
            raise _invalid("tool_choice: there are no tools to choose from", "tool_choice")
        return None
    if len({f.name for f in functions}) != len(functions):
        raise _invalid("tools: two functions share a name", "tools")
    if named is not None:
        if named not in {f.name for f in functions}:
            raise _invalid(f"tool_choice: no tool is named {named!r}", "tool_choice")
        return Tools(functions, named, parallel)
    return Tools(functions, mode or "auto", parallel)


def offer(fields: dict[str, Any], tools: Tools, *, format_param: str) -> None:
    """Give the worker the request's tools in the internal request's `fields` (it tells the model about
    them in the model's tool format and holds a call to their schemas). With `auto`, a format the
    request already gives (`format_param`: its field) holds the answer instead of a call; with a
    required or named call, such a format is refused."""
    if ("json_schema" in fields or "grammar" in fields) and tools.choice not in ("auto", "none"):
        raise _invalid(f"tool_choice: a required call cannot also take {format_param}", "tool_choice")
    fields["tools"] = {"functions": [{"name": f.name, "description": f.description or "", "parameters": f.parameters}
                                     for f in tools.functions],
                       "choice": tools.choice, "parallel": tools.parallel}


def called(calls: list[oa.ToolCall]) -> list[dict[str, str]]:
    """An assistant's earlier calls as the internal chat message carries them."""
    return [{"name": call.function.name, "arguments": call.function.arguments} for call in calls]


def may_be_call(pieces: Iterable[str], tools: Tools) -> bool:
    """Whether an answer that begins with `pieces` may still be calls: nothing but whitespace yet, or the
    start of a JSON object, of a JSON list (with `parallel`) or of a `<tool_call>` block. An answer that
    cannot be is text from its first letters on: it streams as it comes. Only the answer's head is read
    (as many pieces as make `<tool_call>`'s length after the whitespace), so a held answer costs the same
    at each of its tokens."""
    head = ""
    for piece in pieces:
        head = (head + piece).lstrip()
        if len(head) >= len(OPEN_TAG):
            break
    starts = ("{", OPEN_TAG, "[") if tools.parallel else ("{", OPEN_TAG)
    return not head or any(head.startswith(start) or start.startswith(head) for start in starts)


def read_calls(text: str, tools: Tools, request_id: str, *, choice: int = 0) -> list[oa.ToolCall] | None:
    """The calls in an answer, in either of the workers' tool formats: exactly one `{"name", "arguments"}`
    object naming a tool, or (with `parallel`) a JSON list of 1 to MAX_PARALLEL_CALLS of them; or one
    `<tool_call>` block holding such an object, or (with `parallel`) up to MAX_PARALLEL_CALLS blocks
    with only whitespace between them. Else None. A call's id is the same every time for that
    request, choice and place in the answer, and differs between them."""
    listed = _tagged(text) if text.lstrip().startswith(OPEN_TAG) else _plain(text, tools)
    if listed is None or not (1 <= len(listed) <= (MAX_PARALLEL_CALLS if tools.parallel else 1)):
        return None
    if not all(_is_call(c, tools) for c in listed):
        return None
    base = request_id if choice == 0 else f"{request_id}#{choice}"
    return [oa.ToolCall(id="call_" + uuid.uuid5(uuid.NAMESPACE_URL, base if k == 0 else f"{base}/{k}").hex[:24],
                        function=oa.FunctionCall(name=c["name"], arguments=json.dumps(c["arguments"], ensure_ascii=False)))
            for k, c in enumerate(listed)]


def _plain(text: str, tools: Tools) -> list[Any] | None:
    try:
        found = json.loads(text)
    except json.JSONDecodeError:
        return None
    return found if isinstance(found, list) and tools.parallel else [found]


def _tagged(text: str) -> list[Any] | None:
    """The objects in a run of `<tool_call>...</tool_call>` blocks that is the whole text; None otherwise."""
    found, rest = [], text.strip()
    while rest:
        if not (rest.startswith(OPEN_TAG) and CLOSE_TAG in rest):
            return None
        inside, _, rest = rest[len(OPEN_TAG):].partition(CLOSE_TAG)
        try:
            found.append(json.loads(inside))
        except json.JSONDecodeError:
            return None
        rest = rest.lstrip()
    return found


def _is_call(found: Any, tools: Tools) -> bool:
    return (isinstance(found, dict) and found.keys() == {"name", "arguments"} and found["name"] in tools.names
            and isinstance(found["arguments"], dict))


def _invalid(message: str, param: str) -> CoordinatorError:
    return CoordinatorError(reasons.INVALID_REQUEST, message, param=param)
