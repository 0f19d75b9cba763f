"""What tests/integration/test_langchain.py drives the pool with: langchain-openai's `ChatOpenAI`, a tool and a
structured-output model. Its own module, imported by the tests when they run, so that collecting the suite
(each test process collects every file) does not import langchain."""

from __future__ import annotations

from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from pydantic import BaseModel, Field


class City(BaseModel):
    """A city and the country it is in."""

    name: str = Field(max_length=20)
    country: str = Field(max_length=20)
    population: int


@tool
def get_weather(city: str) -> str:
    """The current weather in a city."""
    return "18 degrees and clear"


def chat(url: str, model: str) -> ChatOpenAI:
    return ChatOpenAI(model=model, base_url=url + "/v1", api_key="unused",  # type: ignore[call-arg, arg-type]
                      temperature=0, max_tokens=120, max_retries=0, timeout=60)
