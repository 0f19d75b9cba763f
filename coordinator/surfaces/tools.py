"""Tool calls on the chat and Responses routes, in a generic format any chat model can follow.

Owns: reading `tools` and `tool_choice` (each route reads its own shapes into `Tools` with `choose`),
writing the tools and the conversation's calls and results as
plain chat turns (a system section listing the functions; an assistant's call as the JSON object it
would write; a tool's result as a user turn), the JSON schema that constrains a `required` or named
call, and reading a call back out of the model's answer (out of each choice's, when a request asks
for several: each is constrained by the same schema and read on its own).
Must not: sample or relay; the worker constrains the answer with the schema like any `json_schema`.

The format: the model answers a call as one JSON object `{"name": ..., "arguments": {...}}` and nothing
else. With `tool_choice` `required` or a named function the answer is held to that shape by the
schema (the arguments to the function's own `parameters`). With `auto` the answer is free until its
first word: an answer that opens a JSON object is held to a call to one of the tools from there on
(a lazy grammar, the worker's `grammar_lazy`), any other answer stays free text; it is a call when it
is exactly such an object. With `none` the tools are listed and nothing is read as a call. With
`parallel_tool_calls` (OpenAI's default, true) the model may call several functions in one answer, as
a JSON list of such objects (at most MAX_PARALLEL_CALLS); with false, one call an answer.
This does not use a model template's own tool section (a template that has one is not asked for it
yet); every model gets the same documented format.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from coordinator.errors import CoordinatorError
from protocol import openai as oa
from protocol import reasons

INSTRUCTIONS = ("You can call functions. To call one, answer with only a JSON object of the form "
                '{"name": "<function name>", "arguments": {<arguments>}} and nothing else. ')
SEVERAL = "To call several at once, answer with only a JSON list of such objects. "
LISTING = "The functions, one per line:"
MAX_PARALLEL_CALLS = 8  # calls in one answer, with parallel_tool_calls


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


def listed_in(messages: list[dict[str, str]], tools: Tools | None) -> list[dict[str, str]]:
    """The conversation with the tools listed in its system turn (one is put first if it has none)."""
    if tools is None:
        return messages
    if messages and messages[0]["role"] == "system":
        return [{"role": "system", "content": messages[0]["content"] + "\n\n" + system_text(tools)}, *messages[1:]]
    return [{"role": "system", "content": system_text(tools)}, *messages]


def constrain(fields: dict[str, Any], tools: Tools, *, format_param: str) -> None:
    """Hold the answer to a call (`json_schema`, lazily with `auto`) in the internal request's `fields`.
    With `auto`, a format the request already gives (`format_param`: its field) holds the answer
    instead; with a required or named call, such a format is refused."""
    schema = call_schema(tools)
    if schema is None:
        return
    if "json_schema" in fields or "grammar" in fields:
        if tools.choice != "auto":
            raise _invalid(f"tool_choice: a required call cannot also take {format_param}", "tool_choice")
        return
    fields["json_schema"] = schema
    fields["grammar_lazy"] = tools.choice == "auto"


def system_text(tools: Tools) -> str:
    lines = [json.dumps({"name": f.name, "description": f.description or "", "parameters": f.parameters},
                        ensure_ascii=False) for f in tools.functions]
    return INSTRUCTIONS + (SEVERAL if tools.parallel else "") + LISTING + "\n" + "\n".join(lines)


def calls_text(calls: list[oa.ToolCall]) -> str:
    """An assistant's earlier calls, written as the model writes them: one object, or a list of them."""
    written = [{"name": call.function.name, "arguments": _arguments(call.function.arguments)} for call in calls]
    return json.dumps(written[0] if len(written) == 1 else written, ensure_ascii=False)


def _arguments(text: str | None) -> Any:
    try:
        return json.loads(text or "{}")
    except json.JSONDecodeError:
        return text


def result_text(content: str, call_id: str | None, names: dict[str, str]) -> str:
    """A tool's result, as the user turn that hands it back."""
    name = names.get(call_id or "", "the function")
    return f"Result of {name}: {content}"


def call_schema(tools: Tools) -> dict[str, Any] | None:
    """The schema a call must match: to the named function, or to any of them (`required`, `auto`);
    None with `none`. With `auto` it holds only an answer that starts as a call does (the worker's
    `grammar_lazy`)."""
    if tools.choice == "none":
        return None
    chosen = [f for f in tools.functions if tools.choice in ("required", "auto", f.name)]
    shapes = [{"type": "object", "properties": {"name": {"const": f.name}, "arguments": f.parameters},
               "required": ["name", "arguments"]} for f in chosen]
    one = shapes[0] if len(shapes) == 1 else {"anyOf": shapes}
    if not tools.parallel:
        return one
    return {"anyOf": [*shapes, {"type": "array", "items": one, "minItems": 1, "maxItems": MAX_PARALLEL_CALLS}]}


def read_calls(text: str, tools: Tools, request_id: str, *, choice: int = 0) -> list[oa.ToolCall] | None:
    """The calls in an answer, when it is exactly one `{"name", "arguments"}` object naming a tool, or
    (with `parallel`) a list of 1 to MAX_PARALLEL_CALLS of them; else None. A call's id is the same
    every time for that request, choice and place in the answer, and differs between them."""
    try:
        found = json.loads(text)
    except json.JSONDecodeError:
        return None
    listed = found if isinstance(found, list) and tools.parallel else [found]
    if not (1 <= len(listed) <= MAX_PARALLEL_CALLS and all(_is_call(c, tools) for c in listed)):
        return None
    base = request_id if choice == 0 else f"{request_id}#{choice}"
    return [oa.ToolCall(id="call_" + uuid.uuid5(uuid.NAMESPACE_URL, base if k == 0 else f"{base}/{k}").hex[:24],
                        function=oa.FunctionCall(name=c["name"], arguments=json.dumps(c["arguments"], ensure_ascii=False)))
            for k, c in enumerate(listed)]


def _is_call(found: Any, tools: Tools) -> bool:
    return (isinstance(found, dict) and found.keys() == {"name", "arguments"} and found["name"] in tools.names
            and isinstance(found["arguments"], dict))


def _invalid(message: str, param: str) -> CoordinatorError:
    return CoordinatorError(reasons.INVALID_REQUEST, message, param=param)
