"""Tool calls on the chat route, in a generic format any chat model can follow.

Owns: reading `tools` and `tool_choice`, writing the tools and the conversation's calls and results as
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
is exactly such an object. With `none` the tools are listed and nothing is read as a call. One call per answer (`parallel_tool_calls` is accepted and not used).
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
                '{"name": "<function name>", "arguments": {<arguments>}} and nothing else. '
                "The functions, one per line:")


@dataclass(frozen=True, slots=True)
class Tools:
    functions: tuple[oa.FunctionDef, ...]
    choice: str  # "none", "auto", "required", or the name of the one function to call

    @property
    def names(self) -> frozenset[str]:
        return frozenset(f.name for f in self.functions)

    @property
    def calling(self) -> bool:
        """Whether the answer is read for a call (not with `none`)."""
        return self.choice != "none"


def tools_of(body: oa.ChatCompletionRequest) -> Tools | None:
    if not body.tools:
        if body.tool_choice not in (None, "none"):
            raise _invalid("tool_choice: there are no tools to choose from", "tool_choice")
        return None
    functions = tuple(tool.function for tool in body.tools)
    if len({f.name for f in functions}) != len(functions):
        raise _invalid("tools: two functions share a name", "tools")
    given = body.tool_choice or "auto"
    if isinstance(given, oa.NamedToolChoice):
        name = given.function.get("name", "")
        if name not in {f.name for f in functions}:
            raise _invalid(f"tool_choice: no tool is named {name!r}", "tool_choice")
        return Tools(functions, name)
    return Tools(functions, given)


def system_text(tools: Tools) -> str:
    lines = [json.dumps({"name": f.name, "description": f.description or "", "parameters": f.parameters},
                        ensure_ascii=False) for f in tools.functions]
    return INSTRUCTIONS + "\n" + "\n".join(lines)


def call_text(call: oa.ToolCall) -> str:
    """An earlier call, written as the model writes one."""
    try:
        arguments = json.loads(call.function.arguments or "{}")
    except json.JSONDecodeError:
        arguments = call.function.arguments
    return json.dumps({"name": call.function.name, "arguments": arguments}, ensure_ascii=False)


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
    return shapes[0] if len(shapes) == 1 else {"anyOf": shapes}


def read_call(text: str, tools: Tools, request_id: str, *, choice: int = 0) -> oa.ToolCall | None:
    """The call in an answer, when it is exactly one `{"name", "arguments"}` object naming a tool. Its id
    is the same every time for that request and choice, and differs between a request's choices."""
    try:
        found = json.loads(text)
    except json.JSONDecodeError:
        return None
    if not (isinstance(found, dict) and found.keys() == {"name", "arguments"} and found["name"] in tools.names
            and isinstance(found["arguments"], dict)):
        return None
    ident = "call_" + uuid.uuid5(uuid.NAMESPACE_URL, request_id if choice == 0 else f"{request_id}#{choice}").hex[:24]
    return oa.ToolCall(id=ident, function=oa.FunctionCall(name=found["name"],
                                                          arguments=json.dumps(found["arguments"], ensure_ascii=False)))


def _invalid(message: str, param: str) -> CoordinatorError:
    return CoordinatorError(reasons.INVALID_REQUEST, message, param=param)
