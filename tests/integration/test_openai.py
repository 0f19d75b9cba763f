"""The OpenAI surface end to end: the official `openai` client against the real coordinator and two
real workers running the real model."""

from __future__ import annotations

import asyncio
import json

import httpx
import jsonschema
import openai
import pytest

from bench.agents_check import SCHEMAS
from tests.integration.conftest import Cluster
from tests.integration.test_capacity import hold
from tests.polling import wait_until

pytestmark = [pytest.mark.model, pytest.mark.anyio]
USER = {"role": "user", "content": "Name three colors."}
MODEL = "smollm2-135m-8k-lc100k-mix1-ep2"  # general.name, lower-cased (README: model names)


async def test_chat_streaming_and_not_give_the_same_greedy_text(sdk: openai.AsyncOpenAI) -> None:
    whole = await sdk.chat.completions.create(model="SmolLM2-135M-Instruct.Q4_1", messages=[USER],  # type: ignore[list-item]
                                              max_tokens=16, temperature=0)
    stream = await sdk.chat.completions.create(model=MODEL, messages=[USER], max_tokens=16, temperature=0, stream=True,  # type: ignore[list-item]
                                               stream_options={"include_usage": True})
    chunks = [chunk async for chunk in stream]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert whole.choices[0].message.content == text and text.strip()
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage is not None and whole.usage is not None
    assert usage.completion_tokens == whole.usage.completion_tokens <= 16
    assert usage.prompt_tokens == whole.usage.prompt_tokens > 5
    assert whole.model == chunks[0].model  # the alias answered under the model's own name


async def test_completions_streaming_and_not(sdk: openai.AsyncOpenAI) -> None:
    whole = await sdk.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=8,
                                         temperature=0, logprobs=1)
    stream = await sdk.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=8,
                                          temperature=0, stream=True)
    text = "".join([c.choices[0].text async for c in stream])
    assert whole.choices[0].text == text and whole.choices[0].finish_reason in ("stop", "length")
    logprobs = whole.choices[0].logprobs
    assert logprobs is not None and logprobs.token_logprobs and all(lp <= 0 for lp in logprobs.token_logprobs)
    assert "".join(logprobs.tokens or []) == text


async def test_a_system_prompt_reaches_the_template(sdk: openai.AsyncOpenAI) -> None:
    plain = await sdk.chat.completions.create(model=MODEL, messages=[USER], max_tokens=1)  # type: ignore[list-item]
    system = {"role": "system", "content": "You are a terse assistant who answers with one word."}
    steered = await sdk.chat.completions.create(model=MODEL, messages=[system, USER], max_tokens=1)  # type: ignore[list-item]
    assert plain.usage is not None and steered.usage is not None
    # The template's default system prompt is replaced, not joined by ours as user text.
    assert steered.usage.prompt_tokens != plain.usage.prompt_tokens


async def test_a_three_turn_conversation_stays_on_one_worker(sdk: openai.AsyncOpenAI) -> None:
    history: list[dict[str, str]] = [{"role": "system", "content": "Be brief."}]
    workers, prompts = [], []
    for question in ("What is the sun?", "And the moon?", "Which is bigger?"):
        history.append({"role": "user", "content": question})
        raw = await sdk.chat.completions.with_raw_response.create(model=MODEL, messages=history, max_tokens=12,
                                                                  temperature=0)
        answer = raw.parse()
        workers.append(raw.headers["x-worker-id"])
        assert answer.usage is not None
        prompts.append(answer.usage.prompt_tokens)
        history.append({"role": "assistant", "content": answer.choices[0].message.content or ""})
    assert len(set(workers)) == 1, workers
    assert prompts[0] < prompts[1] < prompts[2]  # each turn saw the whole conversation


async def test_stop_and_max_tokens(sdk: openai.AsyncOpenAI) -> None:
    prompt = "Count from one to ten in words, separated by commas:"
    full = await sdk.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0)
    text = full.choices[0].text
    middle = [i for i in range(len(text) // 2, len(text)) if not text[i].isspace()]
    assert middle, f"premise: the model wrote {text!r}"
    stop = text[middle[0]:middle[0] + 2].strip()
    stopped = await sdk.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0, stop=[stop])
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].text == text[:text.index(stop)]
    short = await sdk.chat.completions.create(model=MODEL, messages=[USER], max_tokens=3, extra_body={"ignore_eos": True})  # type: ignore[list-item]
    assert short.choices[0].finish_reason == "length" and short.usage is not None
    assert short.usage.completion_tokens == 3


async def test_unknown_model_and_overlong_prompt_are_refused(sdk: openai.AsyncOpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as unknown:
        await sdk.chat.completions.create(model="gpt-4o", messages=[USER])  # type: ignore[list-item]
    assert "smollm2" in str(unknown.value)
    # OpenAI's answer to a prompt over the context (agent frameworks catch BadRequestError to shorten it)
    with pytest.raises(openai.BadRequestError) as long:
        await sdk.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "word " * 2000}])  # type: ignore[call-overload]
    assert long.value.status_code == 400
    assert isinstance(long.value.body, dict) and long.value.body["code"] == "context_length_exceeded"


async def test_at_capacity_the_sdk_gets_503(cluster: Cluster, sdk: openai.AsyncOpenAI) -> None:
    body = {"prompt": "Hi", "max_tokens": 120, "ignore_eos": True}
    release, opened = asyncio.Event(), asyncio.Queue()  # type: ignore[var-annotated]
    async with httpx.AsyncClient(timeout=60) as client:
        holders = [asyncio.create_task(hold(client, cluster.url, body, opened, release)) for _ in range(8)]
        try:
            for _ in range(8):
                await asyncio.wait_for(opened.get(), timeout=60)
            with pytest.raises(openai.InternalServerError) as full:
                await sdk.chat.completions.create(model=MODEL, messages=[USER], max_tokens=4)  # type: ignore[list-item]
            assert full.value.status_code == 503
            assert full.value.response.headers["retry-after"] == "1"
            assert isinstance(full.value.body, dict) and full.value.body["code"] == "sessions_full"
        finally:
            release.set()
            await asyncio.gather(*holders, return_exceptions=True)
    wait_until(lambda: cluster.coordinator_health()["requests_running"] == 0, 10, "streams released")
    again = await sdk.chat.completions.create(model=MODEL, messages=[USER], max_tokens=4)  # type: ignore[list-item]
    assert again.choices[0].message.content is not None


async def test_models_lists_the_served_model(sdk: openai.AsyncOpenAI) -> None:
    models = [m async for m in sdk.models.list()]
    assert [m.id for m in models] == [MODEL]
    assert models[0].model_extra is not None and "SmolLM2-135M-Instruct.Q4_1" in models[0].model_extra["aliases"]


async def test_structured_outputs_through_the_sdk_parse_and_validate(sdk: openai.AsyncOpenAI) -> None:
    """`response_format` json_schema, streamed and not: the same schema-valid JSON both ways (greedy)."""
    schema = SCHEMAS["nested"]
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "strict": True, "schema": schema}}
    ask = [{"role": "user", "content": "Give an example person as JSON."}]
    whole = await sdk.chat.completions.create(model=MODEL, messages=ask, temperature=0, max_tokens=200,  # type: ignore[arg-type]
                                              response_format=fmt)  # type: ignore[arg-type]
    text = whole.choices[0].message.content or ""
    jsonschema.validate(json.loads(text), schema)
    assert whole.choices[0].finish_reason == "stop"
    stream = await sdk.chat.completions.create(model=MODEL, messages=ask, temperature=0, max_tokens=200,  # type: ignore[arg-type]
                                               response_format=fmt, stream=True)  # type: ignore[arg-type]
    assert "".join([c.choices[0].delta.content or "" async for c in stream if c.choices]) == text
    with pytest.raises(openai.BadRequestError) as bad:  # refused by the worker while it prepared: still a 400
        await sdk.chat.completions.create(model=MODEL, messages=ask, extra_body={"grammar": "root ::= oops("})  # type: ignore[arg-type]
    assert isinstance(bad.value.body, dict) and "grammar" in bad.value.body["message"]


async def test_a_required_tool_call_and_its_round_trip_with_the_real_model(sdk: openai.AsyncOpenAI) -> None:
    weather = {"type": "function", "function": {
        "name": "get_weather", "description": "The current weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}},
                       "required": ["city"]}}}
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    whole = await sdk.chat.completions.create(model=MODEL, messages=ask, tools=[weather], tool_choice="required",  # type: ignore[arg-type, list-item]
                                              temperature=0, max_tokens=60)
    (call,) = whole.choices[0].message.tool_calls or []
    assert whole.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), weather["function"]["parameters"])  # type: ignore[index]
    stream = await sdk.chat.completions.create(model=MODEL, messages=ask, tools=[weather], tool_choice="required",  # type: ignore[arg-type, list-item]
                                               temperature=0, max_tokens=60, stream=True)
    pieces = [tc for c in [c async for c in stream] if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert "".join((p.function.arguments or "") for p in pieces if p.function) == call.function.arguments
    follow = [*ask, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
              {"role": "tool", "tool_call_id": call.id, "content": "18 degrees and clear"}]
    final = await sdk.chat.completions.create(model=MODEL, messages=follow, tools=[weather], temperature=0,  # type: ignore[arg-type, list-item]
                                              max_tokens=40, tool_choice="none")
    assert final.choices[0].message.content and final.choices[0].finish_reason in ("stop", "length")


# -- several choices (`n`): one worker prefills the prompt once and runs a sequence per choice ----------


def _every_sequence_free(cluster: Cluster) -> bool:
    return all(cluster.worker_load(w)["sessions"] == 0 == cluster.worker_load(w)["kv_reserved_bytes"]
               for w in cluster.workers) and cluster.coordinator_health()["kv_reserved_bytes"] == 0


async def test_n_choices_differ_under_sampling_and_usage_counts_them_all(cluster: Cluster,
                                                                        sdk: openai.AsyncOpenAI) -> None:
    story = {"role": "user", "content": "Tell me a story about a cat."}
    # ignore_eos: every choice runs to max_tokens, so each one's token count is known exactly.
    whole = await sdk.chat.completions.create(model=MODEL, messages=[story], n=4, temperature=1.0,  # type: ignore[list-item]
                                              max_tokens=8, extra_body={"ignore_eos": True})
    assert [c.index for c in whole.choices] == [0, 1, 2, 3]
    texts = [c.message.content or "" for c in whole.choices]
    assert all(texts) and len(set(texts)) > 1
    assert [c.finish_reason for c in whole.choices] == ["length"] * 4
    assert whole.usage is not None and whole.usage.completion_tokens == 4 * 8
    alone = await sdk.chat.completions.create(model=MODEL, messages=[story], max_tokens=1)  # type: ignore[list-item]
    assert alone.usage is not None and whole.usage.prompt_tokens == alone.usage.prompt_tokens  # counted once
    wait_until(lambda: _every_sequence_free(cluster), 10, "every choice's sequence and reservation to be free")


async def test_n_choices_streamed_assemble_into_n_texts_each_with_its_ending(sdk: openai.AsyncOpenAI) -> None:
    stream = await sdk.chat.completions.create(model=MODEL, messages=[USER], n=4, temperature=1.0, max_tokens=12,  # type: ignore[list-item]
                                               stream=True, stream_options={"include_usage": True})
    texts, endings, roles = ["" for _ in range(4)], [None for _ in range(4)], [None for _ in range(4)]
    chunks = [chunk async for chunk in stream]
    for chunk in chunks:
        for choice in chunk.choices:
            roles[choice.index] = roles[choice.index] or choice.delta.role  # type: ignore[call-overload]
            texts[choice.index] += choice.delta.content or ""
            endings[choice.index] = choice.finish_reason or endings[choice.index]  # type: ignore[call-overload]
    assert all(texts) and roles == ["assistant"] * 4
    assert all(ending in ("stop", "length") for ending in endings)
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage is not None and 4 <= usage.completion_tokens <= 4 * 12


async def test_a_seeded_request_of_n_choices_repeats_itself(sdk: openai.AsyncOpenAI) -> None:
    async def ask() -> list[str]:
        answer = await sdk.completions.create(model=MODEL, prompt="Once upon a time", n=2, seed=99,
                                              temperature=1.0, max_tokens=10)
        return [c.text for c in answer.choices]

    first = await ask()
    assert first == await ask() and first[0] != first[1]


async def test_n_past_the_pools_bound_is_a_bad_request(sdk: openai.AsyncOpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        await sdk.chat.completions.create(model=MODEL, messages=[USER], n=9, max_tokens=4)  # type: ignore[list-item]
    assert isinstance(refused.value.body, dict) and refused.value.body["param"] == "n"


async def test_tokenize_counts_what_a_generation_counts_and_detokenize_gives_the_text_back(
        cluster: Cluster, sdk: openai.AsyncOpenAI) -> None:
    """vLLM's /tokenize and /detokenize through the coordinator, answered by a worker's own tokenizer and
    chat template: a chat's count is the prompt tokens its completion reports, a prompt's tokens read back
    as its text, and an id outside the vocabulary is refused by name."""
    chat = await sdk.chat.completions.create(model=MODEL, messages=[USER], max_tokens=1)  # type: ignore[list-item]
    completion = await sdk.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=1)
    assert chat.usage is not None and completion.usage is not None
    async with httpx.AsyncClient(base_url=cluster.url, timeout=30) as http:
        by_chat = (await http.post("/tokenize", json={"model": MODEL, "messages": [USER]})).json()
        assert by_chat["count"] == len(by_chat["tokens"]) == chat.usage.prompt_tokens
        by_prompt = (await http.post("/tokenize", json={"prompt": "The capital of France is",
                                                        "return_token_strs": True})).json()
        assert by_prompt["count"] == completion.usage.prompt_tokens and by_prompt["max_model_len"] > 0
        assert "".join(by_prompt["token_strs"]).endswith("The capital of France is")
        back = (await http.post("/detokenize", json={"model": MODEL, "tokens": by_prompt["tokens"]})).json()
        assert back["prompt"].endswith("The capital of France is")
        refused = await http.post("/detokenize", json={"tokens": [1, 10_000_000]})
        assert refused.status_code == 400 and "tokens.1" in refused.json()["error"]
        unsupported = await http.post("/tokenize", json={"messages": [USER], "add_generation_prompt": False})
        assert unsupported.status_code == 400 and "add_generation_prompt" in unsupported.json()["error"]
        unknown = await http.post("/tokenize", json={"model": "no-such-model", "prompt": "hi"})
        assert unknown.status_code == 404


async def test_a_prompt_of_token_ids_is_served_as_its_text_would_be(cluster: Cluster, sdk: openai.AsyncOpenAI) -> None:
    """`prompt: [ids]` on /v1/completions (as OpenAI's API and vLLM take it): the ids of a text, as
    /tokenize gives them, answer as the text does; an id outside the vocabulary is a 400 naming it."""
    text = "The capital of France is"
    async with httpx.AsyncClient(base_url=cluster.url, timeout=30) as http:
        ids = (await http.post("/tokenize", json={"prompt": text})).json()["tokens"]
    by_text = await sdk.completions.create(model=MODEL, prompt=text, max_tokens=8, temperature=0)
    by_ids = await sdk.completions.create(model=MODEL, prompt=ids, max_tokens=8, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text and by_ids.choices[0].text
    assert by_ids.usage is not None and by_text.usage is not None
    assert by_ids.usage.prompt_tokens == by_text.usage.prompt_tokens == len(ids)
    with pytest.raises(openai.BadRequestError, match=r"prompt\.1: 10000000 is not a token"):
        await sdk.completions.create(model=MODEL, prompt=[ids[0], 10_000_000], max_tokens=1)


async def test_top_logprobs_are_the_models_most_likely_tokens_the_greedy_pick_first(sdk: openai.AsyncOpenAI) -> None:
    """Up to 20 alternatives on chat and 5 on completions, computed by the worker from the raw logits:
    sorted, and with greedy decoding the chosen token first, at the chosen token's own log-probability."""
    chat = await sdk.chat.completions.create(model=MODEL, messages=[USER], max_tokens=6, temperature=0,  # type: ignore[list-item]
                                             logprobs=True, top_logprobs=20)
    content = chat.choices[0].logprobs.content if chat.choices[0].logprobs else None
    assert content
    for entry in content:
        values = [t.logprob for t in entry.top_logprobs]
        assert len(values) == 20 and values == sorted(values, reverse=True)
        assert entry.top_logprobs[0].token == entry.token and entry.top_logprobs[0].logprob == pytest.approx(
            entry.logprob, abs=1e-3)
    text = await sdk.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=4, temperature=0,
                                        logprobs=5)
    logprobs = text.choices[0].logprobs
    assert logprobs is not None and logprobs.top_logprobs and logprobs.tokens
    for chosen, top in zip(logprobs.tokens, logprobs.top_logprobs, strict=True):
        assert len(top) == 5 and max(top, key=top.__getitem__) == chosen
