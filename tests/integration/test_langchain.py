"""langchain-openai, as agent frameworks drive the pool: structured output and tools through `ChatOpenAI`
against the real coordinator and two real workers running the real model (greedy)."""

from __future__ import annotations

import jsonschema
import pytest

from tests.integration.conftest import Cluster
from tests.integration.test_openai import MODEL

pytestmark = [pytest.mark.model]


def test_with_structured_output_gives_a_valid_instance(cluster: Cluster) -> None:
    """`with_structured_output(..., method="json_schema")` sends OpenAI's strict `response_format`; the
    answer must parse into the Pydantic model (pydantic refuses invalid JSON, a raw control character in
    a string included, and values past their bounds)."""
    from tests.integration.langchain_parts import City, chat

    structured = chat(cluster.url, MODEL).with_structured_output(City, method="json_schema", include_raw=True)
    for ask in ("Name a big city in Japan.", "Describe Paris as data."):
        out = structured.invoke(ask)
        assert out["parsing_error"] is None, out["raw"]
        assert isinstance(out["parsed"], City)


def test_bind_tools_calls_the_tool_and_the_round_trip_goes_through_the_template(cluster: Cluster) -> None:
    from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
    from langchain_core.utils.function_calling import convert_to_openai_tool

    from tests.integration.langchain_parts import chat, get_weather

    llm = chat(cluster.url, MODEL)
    ask = HumanMessage("What is the weather in Paris?")
    called = llm.bind_tools([get_weather], tool_choice="required").invoke([ask])
    assert isinstance(called, AIMessage) and called.response_metadata["finish_reason"] == "tool_calls"
    (call,) = called.tool_calls
    assert call["name"] == "get_weather"
    jsonschema.validate(call["args"], convert_to_openai_tool(get_weather)["function"]["parameters"])
    named = llm.bind_tools([get_weather], tool_choice="get_weather").invoke([ask])
    assert [c["name"] for c in named.tool_calls] == ["get_weather"]
    result = ToolMessage(get_weather.invoke(call["args"]), tool_call_id=call["id"])
    final = llm.bind_tools([get_weather], tool_choice="none").invoke([ask, called, result])
    assert isinstance(final, AIMessage) and isinstance(final.content, str) and final.content
    assert final.response_metadata["finish_reason"] in ("stop", "length") and not final.tool_calls
