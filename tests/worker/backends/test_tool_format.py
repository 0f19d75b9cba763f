"""Tools in the prompt and calls held to their schemas (worker/backends/tool_format.py): the format
chosen from a template, the generic format's turns and schema, the tagged format's turns through a
template that lists tools itself, and its grammar checked by llama.cpp on the real vocabulary."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest

from protocol.worker import CalledFunction, ToolFunction, ToolUse
from tests.tagged_model import TEMPLATE
from worker.backends.chat_template import ChatTemplate
from worker.backends.tool_format import GENERIC, TAGGED, call_schema, format_of
from worker.sessions.messages import Message

WEATHER = ToolFunction(name="get_weather", description="The weather in a city.",
                       parameters={"type": "object", "properties": {"unit": {"enum": ["c", "f"]}}, "required": ["unit"]})
TIME = ToolFunction(name="get_time")
CONVERSATION = [Message("system", "Be brief."), Message("user", "Weather in Paris?"),
                Message("assistant", "", (CalledFunction(name="get_weather", arguments='{"unit": "c"}'),
                                          CalledFunction(name="get_time", arguments="{}"))),
                Message("tool", "18 degrees", name="get_weather"), Message("tool", "noon", name="get_time")]


def tools(choice: str = "auto", *, parallel: bool = True) -> ToolUse:
    return ToolUse(functions=(WEATHER, TIME), choice=choice, parallel=parallel)


@pytest.mark.parametrize(("template", "expected"), [
    (TEMPLATE, TAGGED),
    (None, GENERIC),  # no template: plain turns
    ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}", GENERIC),
    # Lists tools, but writes calls some other way: the pool would not read them back.
    ("{{ tools | tojson }}{% for m in messages %}[{{ m.role }}] {{ m.content }}{% endfor %}", GENERIC),
    # Mentions the tag, never lists tools.
    ("{% for m in messages %}{{ m.content }}{% endfor %} <tool_call>", GENERIC),
])
def test_the_format_follows_what_the_template_does(template: str | None, expected: object) -> None:
    assert format_of(template) is expected


def test_the_default_models_template_gets_the_generic_format(model: Any) -> None:
    assert model.tool_format is GENERIC


def test_the_generic_format_lists_the_tools_and_writes_calls_and_results_as_plain_turns() -> None:
    turns, listed = GENERIC.turns(CONVERSATION, tools())
    assert listed is None  # the template is told nothing of tools
    assert [t["role"] for t in turns] == ["system", "user", "assistant", "user", "user"]
    system = turns[0]["content"]
    assert system.startswith("Be brief.\n\nYou can call functions.") and "JSON list" in system
    assert [json.loads(line)["name"] for line in system.splitlines()[-2:]] == ["get_weather", "get_time"]
    # Earlier calls as words, not the JSON of a call, which a small model copies instead of answering.
    assert turns[2]["content"] == "I called get_weather with unit c, and get_time."
    assert GENERIC.turns([Message("assistant", "", (CalledFunction(
        name="f", arguments='{"city": "Paris", "days": 3, "at": {"hour": 9}}'),))], None)[0][0]["content"] == (
        'I called f with city Paris, days 3, at {"hour": 9}.')
    assert [t["content"] for t in turns[3:]] == ["Result of get_weather: 18 degrees", "Result of get_time: noon"]
    # Without parallel calls the instructions do not offer a list; without a system turn one comes first.
    alone, _ = GENERIC.turns([Message("user", "Hi")], tools(parallel=False))
    assert alone[0]["role"] == "system" and "JSON list" not in alone[0]["content"] and alone[1]["content"] == "Hi"
    # Without tools a conversation's calls and results are still plain turns.
    assert [t["role"] for t in GENERIC.turns(CONVERSATION, None)[0]] == ["system", "user", "assistant", "user", "user"]


def test_the_generic_format_holds_a_call_to_the_chosen_functions_schemas() -> None:
    required = GENERIC.constraint(tools("required"))
    assert required is not None and required.grammar is None and required.lazy is False
    call = {"name": "get_weather", "arguments": {"unit": "c"}}
    jsonschema.validate(call, required.json_schema)
    jsonschema.validate([call, {"name": "get_time", "arguments": {}}], required.json_schema)
    for wrong in ({"name": "get_weather", "arguments": {"unit": "kelvin"}}, {"name": "get_mood", "arguments": {}},
                  {"name": "get_time"}, []):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(wrong, required.json_schema)
    named = GENERIC.constraint(tools("get_time", parallel=False))
    assert named is not None and named.json_schema == call_schema(tools("get_time"), several=False)
    with pytest.raises(jsonschema.ValidationError):  # only the named function, one call
        jsonschema.validate(call, named.json_schema)
    auto = GENERIC.constraint(tools("auto"))
    assert auto is not None and auto.lazy is True
    assert GENERIC.constraint(tools("none")) is None


def test_the_tagged_format_hands_the_template_the_tools_and_the_calls_as_hugging_face_names_them() -> None:
    turns, listed = TAGGED.turns(CONVERSATION, tools())
    assert listed == [{"type": "function", "function": {"name": f.name, "description": f.description,
                                                         "parameters": f.parameters}} for f in (WEATHER, TIME)]
    assert turns[0] == {"role": "system", "content": "Be brief."}
    assert turns[2]["tool_calls"] == [{"type": "function", "function": {"name": "get_weather", "arguments": {"unit": "c"}}},
                                      {"type": "function", "function": {"name": "get_time", "arguments": {}}}]
    assert turns[3] == {"role": "tool", "content": "18 degrees", "name": "get_weather"}
    prompt = ChatTemplate(TEMPLATE, bos="", eos="", strip_bos=False).render(turns, listed)
    assert prompt.startswith("<|im_start|>system\nBe brief.\n\nFunctions you may call")
    assert json.dumps(listed[0]) in prompt and "You can call functions" not in prompt  # its own section only
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"unit": "c"}}\n</tool_call>' in prompt
    assert "<tool_response>\nnoon\n</tool_response>" in prompt and prompt.endswith("<|im_start|>assistant\n")


def grammar_takes(model: Any, gbnf: str, text: str) -> bool:
    """Whether llama.cpp's grammar sampler lets the model write exactly `text` and then end."""
    grammar = model.constraint(grammar=gbnf, json_schema=None)
    try:
        for token in model.tokenize(text, add_special=False):
            if not grammar.allows(token):
                return False
            grammar.accept(token)
        return bool(grammar.allows(grammar.end))
    finally:
        grammar.close()


def test_the_tagged_format_holds_an_answer_to_call_blocks_on_the_real_vocabulary(model: Any) -> None:
    block = '<tool_call>\n{"name": "get_weather", "arguments": {"unit": "f"}}\n</tool_call>'
    other = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    required = TAGGED.constraint(tools("required"))
    assert required is not None and required.json_schema is None and required.grammar is not None
    assert not required.lazy
    assert grammar_takes(model, required.grammar, block)
    assert grammar_takes(model, required.grammar, block + "\n" + other)  # parallel: one block a call
    for wrong in ('{"name": "get_weather", "arguments": {"unit": "f"}}',  # no tags
                  block.replace('"f"', '"kelvin"'), block.replace("get_weather", "get_mood"),
                  block[:-3], "Sure! " + block):
        assert not grammar_takes(model, required.grammar, wrong), wrong
    single = TAGGED.constraint(tools("get_time", parallel=False))
    assert single is not None and single.grammar is not None
    assert grammar_takes(model, single.grammar, other)
    assert not grammar_takes(model, single.grammar, other + "\n" + other)
    assert not grammar_takes(model, single.grammar, block)
    auto = TAGGED.constraint(tools("auto"))
    assert auto is not None and auto.lazy and TAGGED.constraint(tools("none")) is None
