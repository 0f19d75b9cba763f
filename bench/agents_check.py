"""The API agents use, counted: what share of structured-output and tool-call answers from a running
pool are valid, through the clients agents use (the official `openai` package and langchain-openai).

Owns: the asks (four JSON schemas, twenty tool questions, a banned token, repeating answers), the counts
it prints and bench/results/agents_check.json.
Must not: start or change the pool: it talks to the one at `--url` (`./start.sh` by default) and only
to it.

    ./start.sh &
    .venv/bin/python -m bench.agents_check [--url http://127.0.0.1:1337] [--model-path modelFiles/...]

Every answer but `n`'s is greedy (temperature 0), so a run repeats itself; the asks differ so the
answers do.
For each count it says how many answers passed of how many were asked:
  json_schema (sdk|langchain)  the answer parses as JSON and validates against its schema (`jsonschema`)
  tool_choice required|named   exactly one call to the function, its arguments valid against its schema
  streamed == whole            the streamed deltas assemble into the same call (name and arguments)
  round trip                   call, tool result, answer: the last answer is text, with no error
  responses ...                the same asks through `client.responses.create`: json_schema as
                               `text.format`, a required call (a `function_call` item), streamed ==
                               whole, and the round trip with a `function_call_output` item
  logit_bias -100              the token held by the most of 20 greedy answers (by `logprobs`; its id
                               found by tokenizing its text) is banned: how many answers hold it then
  presence_penalty             of the greedy answers that repeat a token, how many a penalty changes
  prompt tokens (--compare-template)  four chats' prompt tokens, the pool against llama-server --jinja
  n 4                          four choices under sampling (temperature 1): indices, different texts,
                               usage summed over the choices
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import jsonschema
import openai

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_MODEL = ROOT / "modelFiles" / "SmolLM2-135M-Instruct.Q4_1.gguf"
RESULTS = ROOT / "bench" / "results"

# Four kinds of schema an agent asks for: nested objects, arrays, enums, required fields.
SCHEMAS: dict[str, dict[str, Any]] = {
    "nested": {"type": "object", "required": ["name", "address"], "properties": {
        "name": {"type": "string", "maxLength": 20},
        "address": {"type": "object", "required": ["city", "zip"],
                    "properties": {"city": {"type": "string", "maxLength": 20}, "zip": {"type": "integer"}}}}},
    "array": {"type": "object", "required": ["colors"], "properties": {
        "colors": {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 1, "maxItems": 3}}},
    "enum": {"type": "object", "required": ["mood", "score"], "properties": {
        "mood": {"enum": ["happy", "sad", "calm"]}, "score": {"type": "integer"}}},
    "required": {"type": "object", "required": ["title", "year", "tags"], "properties": {
        "title": {"type": "string", "maxLength": 30}, "year": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 10}, "maxItems": 2}}},
}
SCHEMA_ASKS = {
    "nested": ["a person who lives in Lyon", "a doctor in Boston", "a child in Tokyo", "a baker in Rome",
               "a pilot in Oslo"],
    "array": ["the colors of a rainbow", "the colors of the French flag", "the colors of a zebra",
              "the colors of autumn leaves", "the colors of the sea"],
    "enum": ["a sunny holiday", "a lost wallet", "a quiet evening", "a birthday party", "a rainy Monday"],
    "required": ["a famous film", "a book about the sea", "a song from 1990", "a play by Shakespeare",
                 "a film about space"],
}
CITIES = ["Paris", "Berlin", "Madrid", "Rome", "Vienna", "Lisbon", "Dublin", "Prague", "Athens", "Oslo",
          "Tokyo", "Lima", "Cairo", "Delhi", "Sydney", "Toronto", "Nairobi", "Seoul", "Quito", "Hanoi"]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}},
                   "required": ["city"]}}}


def schema_counts(client: openai.OpenAI, model: str) -> tuple[int, int]:
    passed = asked = 0
    for name, schema in SCHEMAS.items():
        fmt = {"type": "json_schema", "json_schema": {"name": name, "strict": True, "schema": schema}}
        for ask in SCHEMA_ASKS[name]:
            asked += 1
            answer = client.chat.completions.create(
                model=model, temperature=0, max_tokens=200, response_format=fmt,  # type: ignore[call-overload]
                messages=[{"role": "user", "content": f"Describe {ask} as JSON."}])
            passed += _valid(answer.choices[0].message.content or "", schema)
    return passed, asked


def langchain_schema_counts(url: str, model: str) -> tuple[int, int]:
    from langchain_openai import ChatOpenAI

    chat = ChatOpenAI(model=model, base_url=url + "/v1", api_key="unused",  # type: ignore[call-arg, arg-type]
                      temperature=0, max_tokens=200, max_retries=0, timeout=120)
    passed = asked = 0
    for name, schema in SCHEMAS.items():
        structured = chat.with_structured_output({"title": name, **schema}, method="json_schema", include_raw=True)
        for ask in SCHEMA_ASKS[name]:
            asked += 1
            out = structured.invoke(f"Describe {ask} as JSON.")
            try:
                jsonschema.validate(out["parsed"], schema)
                passed += out["parsing_error"] is None
            except jsonschema.ValidationError:
                pass
    return passed, asked


def tool_counts(client: openai.OpenAI, model: str) -> dict[str, list[int]]:
    counts = {"required": [0, 0], "named": [0, 0], "streamed == whole": [0, 0], "round trip": [0, 0]}
    named = {"type": "function", "function": {"name": "get_weather"}}
    for city in CITIES:
        ask = [{"role": "user", "content": f"What is the weather in {city} today?"}]
        for kind, choice in (("required", "required"), ("named", named)):
            whole = client.chat.completions.create(model=model, messages=ask, tools=[WEATHER],  # type: ignore[call-overload]
                                                   tool_choice=choice, temperature=0, max_tokens=60)
            calls = whole.choices[0].message.tool_calls or []
            counts[kind][1] += 1
            ok = (len(calls) == 1 and calls[0].function.name == "get_weather"
                  and whole.choices[0].finish_reason == "tool_calls"
                  and _valid(calls[0].function.arguments, WEATHER["function"]["parameters"]))  # type: ignore[index]
            counts[kind][0] += ok
            if kind != "required" or not ok:
                continue
            stream = client.chat.completions.create(model=model, messages=ask, tools=[WEATHER],  # type: ignore[call-overload]
                                                    tool_choice=choice, temperature=0, max_tokens=60, stream=True)
            pieces = [tc for c in stream if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
            name = "".join(p.function.name or "" for p in pieces if p.function)
            arguments = "".join(p.function.arguments or "" for p in pieces if p.function)
            counts["streamed == whole"][1] += 1
            counts["streamed == whole"][0] += (name, arguments) == (calls[0].function.name, calls[0].function.arguments)
            follow = [*ask, {"role": "assistant", "content": None, "tool_calls": [calls[0].model_dump()]},
                      {"role": "tool", "tool_call_id": calls[0].id, "content": "18 degrees and clear"}]
            final = client.chat.completions.create(model=model, messages=follow, tools=[WEATHER],  # type: ignore[call-overload]
                                                   tool_choice="none", temperature=0, max_tokens=40)
            counts["round trip"][1] += 1
            counts["round trip"][0] += bool(final.choices[0].message.content)
    return counts


def logit_bias_counts(client: openai.OpenAI, model: str, model_path: Path) -> dict[str, Any]:
    """Finds the token that the most of 20 greedy answers hold, bans it with -100, and asks again: how
    many answers hold it without the bias and with it."""
    from worker.backends.llama_model import Model

    asks = [f"Describe {ask}." for asks in SCHEMA_ASKS.values() for ask in asks]

    def tokens(ask: str, bias: dict[str, int] | None) -> list[str]:
        answer = client.chat.completions.create(model=model, temperature=0, max_tokens=32, logprobs=True,
                                                logit_bias=bias, messages=[{"role": "user", "content": ask}])
        logprobs = answer.choices[0].logprobs
        return [t.token for t in (logprobs.content or [])] if logprobs else []

    plain = [tokens(ask, None) for ask in asks]
    loaded = Model(model_path)
    try:
        common = sorted({t for answer in plain for t in answer}, key=lambda t: -sum(t in a for a in plain))
        text, token = next((t, ids[0]) for t in common if len(ids := loaded.tokenize(t, add_special=False)) == 1)
    finally:
        loaded.close()
    banned = [tokens(ask, {str(token): -100}) for ask in asks]
    return {"token": text, "answers": len(asks), "holding it without the bias": sum(text in a for a in plain),
            "holding it with the bias": sum(text in a for a in banned)}


def presence_counts(client: openai.OpenAI, model: str) -> dict[str, int]:
    """Of greedy answers that repeat a token, how many a presence penalty of 1.5 changes."""
    counts = {"asked": 0, "repeating": 0, "changed by the penalty": 0}
    for ask in ("List fruits.", "Write a poem about the sea.", "Say 'ha' many times.", "List ten animals."):
        messages = [{"role": "user", "content": ask}]
        plain = client.chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=40,  # type: ignore[arg-type]
                                               logprobs=True)
        tokens = [t.token for t in (plain.choices[0].logprobs.content or [])] if plain.choices[0].logprobs else []
        penalised = client.chat.completions.create(model=model, messages=messages, temperature=0,  # type: ignore[arg-type]
                                                   max_tokens=40, presence_penalty=1.5)
        counts["asked"] += 1
        if len(set(tokens)) < len(tokens):
            counts["repeating"] += 1
            counts["changed by the penalty"] += plain.choices[0].message.content != penalised.choices[0].message.content
    return counts


def choices_counts(client: openai.OpenAI, model: str) -> dict[str, int]:
    """`n: 4` under sampling, ten asks: how many answers had 4 choices (indices 0..3), how many had 4
    different texts, and how many counted every choice's tokens in `usage` (each choice forced to
    `max_tokens` with `ignore_eos`, so the sum is known: 4 x 12)."""
    counts = {"asked": 0, "4 choices": 0, "4 different": 0, "usage counts all": 0}
    for city in CITIES[:10]:
        answer = client.chat.completions.create(
            model=model, n=4, temperature=1.0, max_tokens=12, extra_body={"ignore_eos": True},
            messages=[{"role": "user", "content": f"Write one sentence about {city}."}])
        counts["asked"] += 1
        counts["4 choices"] += [c.index for c in answer.choices] == [0, 1, 2, 3]
        counts["4 different"] += len({c.message.content for c in answer.choices}) == 4
        counts["usage counts all"] += answer.usage is not None and answer.usage.completion_tokens == 4 * 12
    return counts


def template_counts(client: openai.OpenAI, model: str, model_path: Path) -> dict[str, list[int]]:
    """Prompt tokens of the same chats through the pool and through llama-server `--jinja` (the model's
    own Jinja template, llama.cpp's way), same model: equal counts mean the same rendering, the
    template's default system prompt included."""
    from bench.llama_server import LlamaServer

    chats = [[{"role": "user", "content": "Hello"}],
             [{"role": "user", "content": "What is the capital of France?"}],
             [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"}],
             [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! How can I help?"},
              {"role": "user", "content": "Tell me a joke."}]]

    def counts(target: openai.OpenAI, name: str) -> list[int]:
        usages = [target.chat.completions.create(model=name, messages=chat, max_tokens=1,  # type: ignore[arg-type]
                                                 temperature=0).usage for chat in chats]
        return [usage.prompt_tokens if usage else -1 for usage in usages]

    with LlamaServer(model_path, threads=1, extra_args=("--jinja",)) as peer:
        theirs = counts(openai.OpenAI(base_url=peer.url + "/v1", api_key="unused", max_retries=0), "peer")
    return {"pool": counts(client, model), "llama-server --jinja": theirs}


def responses_counts(client: openai.OpenAI, model: str) -> dict[str, list[int]]:
    """The schema and tool asks again, through the Responses API."""
    counts = {"json_schema": [0, 0], "required": [0, 0], "streamed == whole": [0, 0], "round trip": [0, 0]}
    for name, schema in SCHEMAS.items():
        text: Any = {"format": {"type": "json_schema", "name": name, "strict": True, "schema": schema}}
        for ask in SCHEMA_ASKS[name]:
            got = client.responses.create(model=model, temperature=0, max_output_tokens=200, text=text,
                                          input=f"Describe {ask} as JSON.")
            counts["json_schema"][1] += 1
            counts["json_schema"][0] += _valid(got.output_text, schema)
    tool: Any = {"type": "function", **WEATHER["function"]}  # type: ignore[dict-item]
    for city in CITIES:
        ask = f"What is the weather in {city} today?"
        whole = client.responses.create(model=model, input=ask, tools=[tool], tool_choice="required",
                                        temperature=0, max_output_tokens=60)
        calls = [item for item in whole.output if item.type == "function_call"]
        counts["required"][1] += 1
        ok = len(calls) == 1 and calls[0].name == "get_weather" and _valid(calls[0].arguments, tool["parameters"])
        counts["required"][0] += ok
        if not ok:
            continue
        stream = client.responses.create(model=model, input=ask, tools=[tool], tool_choice="required",
                                         temperature=0, max_output_tokens=60, stream=True)
        arguments = "".join(e.delta for e in stream if e.type == "response.function_call_arguments.delta")
        counts["streamed == whole"][1] += 1
        counts["streamed == whole"][0] += arguments == calls[0].arguments
        history: Any = [{"role": "user", "content": ask}, calls[0].model_dump(exclude_none=True),
                        {"type": "function_call_output", "call_id": calls[0].call_id, "output": "18 degrees and clear"}]
        final = client.responses.create(model=model, input=history, tools=[tool], tool_choice="none",
                                        temperature=0, max_output_tokens=40)
        counts["round trip"][1] += 1
        counts["round trip"][0] += bool(final.output_text)
    return counts


def _valid(text: str, schema: dict[str, Any]) -> bool:
    try:
        jsonschema.validate(json.loads(text), schema)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:1337")
    parser.add_argument("--model-path", type=Path, default=DEFAULT_MODEL, help="the pool's model, for the banned token")
    parser.add_argument("--out", type=Path, default=RESULTS / "agents_check.json")
    parser.add_argument("--compare-template", action="store_true",
                        help="also count 4 chats' prompt tokens through llama-server --jinja (built on first use, "
                             "bench/llama_server.py)")
    args = parser.parse_args(argv)
    client = openai.OpenAI(base_url=args.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    results: dict[str, Any] = {"model": model}
    results["json_schema (sdk)"] = schema_counts(client, model)
    results["json_schema (langchain)"] = langchain_schema_counts(args.url, model)
    results.update({f"tool_choice {k}" if k in ("required", "named") else k: tuple(v)
                    for k, v in tool_counts(client, model).items()})
    results.update({f"responses {k}": tuple(v) for k, v in responses_counts(client, model).items()})
    results["logit_bias -100"] = logit_bias_counts(client, model, args.model_path)
    results["presence_penalty 1.5"] = presence_counts(client, model)
    results["n 4"] = choices_counts(client, model)
    if args.compare_template:
        results["prompt tokens of 4 chats"] = template_counts(client, model, args.model_path)
    for name, value in results.items():
        shown = f"{value[0]} of {value[1]}" if isinstance(value, tuple) else value
        print(f"  {name:<36} {shown}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
