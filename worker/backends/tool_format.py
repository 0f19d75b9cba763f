"""How a chat's tools reach the model, and what a call is held to: the model's own template's tool
section when it has one this module knows, else a generic format any chat model can follow.

Owns: choosing a model's tool format from its chat template's text (`format_of`), writing a
conversation (its tools, an assistant's earlier calls, the tools' results) as the turns and tool list
that format hands the template, and the constraint (a JSON schema or a GBNF grammar) that holds an
answer to a call of the request's functions.
Must not: render a template or compile a grammar (chat_template.py and engine/grammar.py do), or read
calls back out of an answer: the coordinator does (coordinator/surfaces/tools.py reads both formats,
so it need not know which model answered).

The formats:
- **generic**, for a template that does not list tools itself (SmolLM2's and Gemma 3's, and a model
  with no template). The functions are listed in the system turn, one JSON object per line, after an
  instruction to answer a call with only `{"name": ..., "arguments": {...}}` (several calls, with
  `parallel`: a JSON list of such objects). An assistant's earlier calls are written back as a
  sentence naming each function and its arguments (`I called get_weather with unit c.`), not as the
  JSON a call is: given its own call as JSON and then the result, a small model (SmolLM2-135M) writes
  the same call again rather than answer from the result (llama.cpp's server suite's
  `test_calc_result`, docs/evaluation.md). A tool's result is a user turn `Result of NAME: ...`.
- **tagged**, for a template that lists `tools` itself and writes calls as `<tool_call>` blocks (the
  Hermes 2 Pro format, which Qwen 2.5 and 3 and many later templates use). The template gets `tools`
  and the conversation as Hugging Face's chat format has it (`tool_calls` on an assistant's turn with
  its arguments as an object, `tool` turns), and writes its own tool section; a call is
  `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, one block a call.
  A template that lists tools in another way (Llama 3.1's, Mistral's `[TOOL_CALLS]`, ...) gets the
  generic format: the pool would not read its calls back.

In both, `required` or a named function holds the whole answer to a call (to the named function's
schema, or any of them); `auto` holds an answer that starts as a call does (a lazy grammar) and leaves
any other answer free; `none` lists the tools and holds nothing.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from protocol.worker import MAX_PARALLEL_CALLS, CalledFunction, ToolUse
from worker.sessions.messages import Message

INSTRUCTIONS = ("You can call functions. To call one, answer with only a JSON object of the form "
                '{"name": "<function name>", "arguments": {<arguments>}} and nothing else. ')
SEVERAL = "To call several at once, answer with only a JSON list of such objects. "
LISTING = "The functions, one per line:"
OPEN_TAG, CLOSE_TAG = "<tool_call>", "</tool_call>"
_LISTS_TOOLS = re.compile(r"\btools\b")
_CALL_RULE = "tool-call-object"


@dataclass(frozen=True, slots=True)
class CallConstraint:
    """What holds an answer to a call: exactly one of a grammar and a schema; `lazy` for `auto`."""

    grammar: str | None
    json_schema: dict[str, Any] | None
    lazy: bool


class ToolFormat(Protocol):
    name: str

    def turns(self, messages: Sequence[Message], tools: ToolUse | None
              ) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
        """The turns to hand the template, and its `tools` (None: the template is given none)."""
        ...

    def constraint(self, tools: ToolUse) -> CallConstraint | None: ...


def format_of(template: str | None) -> ToolFormat:
    """The tool format a chat template speaks: tagged when it lists `tools` and writes `<tool_call>`
    blocks, else generic."""
    if template is not None and _LISTS_TOOLS.search(template) and OPEN_TAG in template:
        return TAGGED
    return GENERIC


def call_schema(tools: ToolUse, *, several: bool) -> dict[str, Any]:
    """The schema of one call object (to the named function, or to any); `several`: or a list of 1 to
    MAX_PARALLEL_CALLS of them."""
    chosen = [f for f in tools.functions if tools.choice in ("required", "auto", f.name)]
    shapes = [{"type": "object", "properties": {"name": {"const": f.name}, "arguments": f.parameters},
               "required": ["name", "arguments"]} for f in chosen]
    one = shapes[0] if len(shapes) == 1 else {"anyOf": shapes}
    if not several:
        return one
    return {"anyOf": [*shapes, {"type": "array", "items": one, "minItems": 1, "maxItems": MAX_PARALLEL_CALLS}]}


def _arguments(text: str) -> Any:
    """A call's arguments as an object when they are JSON (as templates expect them), else as given."""
    try:
        return json.loads(text or "{}")
    except json.JSONDecodeError:
        return text


def _with(arguments: Any) -> str:
    """` with` a call's arguments as words (`unit c, days 3`; a value other than a string as JSON), or ""."""
    if not arguments:
        return ""
    if isinstance(arguments, dict):
        return " with " + ", ".join(f"{k} {v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)}"
                                    for k, v in arguments.items())
    return " with " + (arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False))


class _Generic:
    name = "generic"

    def turns(self, messages: Sequence[Message], tools: ToolUse | None
              ) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
        out: list[dict[str, Any]] = []
        for m in messages:
            if m.role == "tool":
                out.append({"role": "user", "content": f"Result of {m.name or 'the function'}: {m.content}"})
            elif m.tool_calls:
                out.append({"role": "assistant", "content": self.calls_text(m.tool_calls)})
            else:
                out.append({"role": m.role, "content": m.content})
        if tools is None:
            return out, None
        if out and out[0]["role"] == "system":
            return [{"role": "system", "content": out[0]["content"] + "\n\n" + self.listing(tools)}, *out[1:]], None
        return [{"role": "system", "content": self.listing(tools)}, *out], None

    @staticmethod
    def listing(tools: ToolUse) -> str:
        lines = [json.dumps({"name": f.name, "description": f.description, "parameters": f.parameters},
                            ensure_ascii=False) for f in tools.functions]
        return INSTRUCTIONS + (SEVERAL if tools.parallel else "") + LISTING + "\n" + "\n".join(lines)

    @staticmethod
    def calls_text(calls: Sequence[CalledFunction]) -> str:
        """Earlier calls as a sentence: `I called f with a 1, b x, and g.`"""
        return "I called " + ", and ".join(c.name + _with(_arguments(c.arguments)) for c in calls) + "."

    def constraint(self, tools: ToolUse) -> CallConstraint | None:
        if tools.choice == "none":
            return None
        return CallConstraint(None, call_schema(tools, several=tools.parallel), lazy=tools.choice == "auto")


class _Tagged:
    name = "tagged"

    def turns(self, messages: Sequence[Message], tools: ToolUse | None
              ) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
        out: list[dict[str, Any]] = []
        for m in messages:
            turn: dict[str, Any] = {"role": m.role, "content": m.content}
            if m.tool_calls:
                turn["tool_calls"] = [{"type": "function", "function": {"name": c.name, "arguments": _arguments(c.arguments)}}
                                      for c in m.tool_calls]
            if m.role == "tool" and m.name:
                turn["name"] = m.name
            out.append(turn)
        listed = None if tools is None else [
            {"type": "function", "function": {"name": f.name, "description": f.description, "parameters": f.parameters}}
            for f in tools.functions]
        return out, listed

    def constraint(self, tools: ToolUse) -> CallConstraint | None:
        if tools.choice == "none":
            return None
        # Imported here: the converter is llama-cpp-python's, and the simulated engine, which formats
        # tool calls too, must run where llama.cpp is not built (bench/gpu_check.sh scale).
        from worker.engine.grammar import gbnf_of

        one = gbnf_of(grammar=None, json_schema=call_schema(tools, several=False))
        assert one is not None
        # The schema's grammar, its root renamed, inside the block's tags; one block a call.
        inner = re.sub(r"^root ::=", f"{_CALL_RULE} ::=", one, count=1, flags=re.MULTILINE)
        block = f'"{OPEN_TAG}\\n" {_CALL_RULE} "\\n{CLOSE_TAG}"'
        more = f' ("\\n" {block}){{0,{MAX_PARALLEL_CALLS - 1}}}' if tools.parallel else ""
        return CallConstraint(f"root ::= {block}{more}\n{inner}", None, lazy=tools.choice == "auto")


GENERIC: ToolFormat = _Generic()
TAGGED: ToolFormat = _Tagged()
