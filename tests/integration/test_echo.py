"""`echo` with `logprobs` through the official `openai` client, the real coordinator and workers: what an
evaluation harness (lm-evaluation-harness's `local-completions`) asks to score a multiple-choice answer.

The prompt's log-probabilities are checked against llama.cpp's own logits for the same model, computed here
with llama-cpp-python's `Llama` keeping every position's logits, as the worker computes them: flash attention
on (llama.cpp's default for the worker's context) and batches of SCORE_CHUNK tokens. llama.cpp's kernels
round differently with other shapes (the prompt in one batch) and without flash attention: a reference made
either way misses the worker's numbers by more than TOLERANCE.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import llama_cpp
import numpy as np
import openai
import pytest

from tests.integration.conftest import Cluster
from tests.integration.test_openai import MODEL
from worker.engine.scoring import SCORE_CHUNK

pytestmark = [pytest.mark.model, pytest.mark.anyio]
# About 90 tokens: scored in two chunks of the worker's SCORE_CHUNK (64).
CONTEXT = "Question: which of these is a colour of the sky on a clear day? " * 6 + "Answer:"
TOLERANCE = 0.05  # the bound between the pool's numbers and llama.cpp's own


@pytest.fixture(scope="module")
def reference(model_path: Path) -> Iterator[llama_cpp.Llama]:
    llm = llama_cpp.Llama(str(model_path), logits_all=True, n_ctx=512, n_threads=1, flash_attn=True,
                          n_batch=SCORE_CHUNK, n_ubatch=SCORE_CHUNK, verbose=False)
    yield llm
    llm.close()


def own_logprobs(llm: llama_cpp.Llama, text: str) -> tuple[list[int], list[float]]:
    """The text's tokens (as a raw completion's prompt is tokenized) and each one's log-probability given
    those before it, from the logits llama.cpp computes for every position (the first has none)."""
    tokens = llm.tokenize(text.encode(), add_bos=False, special=True)
    llm.reset()
    llm.eval(tokens)
    scores = np.array(llm.scores[: len(tokens)], dtype=np.float64)
    top = scores.max(axis=1)
    log_z = top + np.log(np.exp(scores - top[:, None]).sum(axis=1))
    return tokens, [float(scores[p - 1, tokens[p]] - log_z[p - 1]) for p in range(1, len(tokens))]


async def test_a_harness_loglikelihood_request_gets_the_prompts_logprobs_as_llama_cpp_computes_them(
        sdk: openai.AsyncOpenAI, reference: llama_cpp.Llama) -> None:
    prompt = CONTEXT + " blue"
    # lm-evaluation-harness's loglikelihood request, as its local-completions model sends it.
    answer = await sdk.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0, logprobs=1,
                                          echo=True, seed=1234)
    choice = answer.choices[0]
    lp = choice.logprobs
    assert lp is not None and lp.tokens and lp.token_logprobs and lp.top_logprobs and lp.text_offset
    tokens, expected = own_logprobs(reference, prompt)
    assert answer.usage is not None and answer.usage.prompt_tokens == len(tokens) > 64
    # The prompt's tokens, then the one generated: what the harness slices with [ctxlen:-1].
    assert len(lp.tokens) == len(tokens) + 1 and choice.text.startswith(prompt)
    assert "".join(lp.tokens) == choice.text
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    got = lp.token_logprobs[1 : len(tokens)]
    worst = max(abs(g - e) for g, e in zip(got, expected, strict=True))  # type: ignore[operator]
    assert worst <= TOLERANCE, worst
    # The harness's greedy check: a token that was the most likely has exactly the top entry's value.
    greedy = [p for p in range(1, len(tokens)) if lp.top_logprobs[p] and lp.tokens[p] in lp.top_logprobs[p]]
    assert greedy and all(lp.top_logprobs[p][lp.tokens[p]] == lp.token_logprobs[p] for p in greedy)
    assert all(len(entry) == 1 for entry in lp.top_logprobs[1:])  # logprobs=1
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]


async def test_echo_streamed_is_the_whole_answer_and_a_prompt_of_ids_scores_the_same(
        sdk: openai.AsyncOpenAI, reference: llama_cpp.Llama) -> None:
    prompt = CONTEXT + " green"
    whole = await sdk.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0, logprobs=2,
                                         echo=True)
    stream = await sdk.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0, logprobs=2,
                                          echo=True, stream=True)
    chunks = [c.choices[0] async for c in stream if c.choices]
    assert "".join(c.text for c in chunks) == whole.choices[0].text
    streamed = [v for c in chunks if c.logprobs for v in c.logprobs.token_logprobs or []]
    assert whole.choices[0].logprobs is not None and streamed == whole.choices[0].logprobs.token_logprobs
    tokens, _ = own_logprobs(reference, prompt)
    ids = await sdk.completions.create(model=MODEL, prompt=tokens, max_tokens=0, logprobs=0, echo=True)
    assert ids.choices[0].text == prompt and ids.usage is not None and ids.usage.completion_tokens == 0
    assert ids.choices[0].logprobs is not None
    assert ids.choices[0].logprobs.token_logprobs == whole.choices[0].logprobs.token_logprobs[: len(tokens)]


async def test_echo_without_logprobs_and_a_bad_max_tokens(sdk: openai.AsyncOpenAI) -> None:
    answer = await sdk.completions.create(model=MODEL, prompt="The sea is", max_tokens=4, temperature=0, echo=True)
    plain = await sdk.completions.create(model=MODEL, prompt="The sea is", max_tokens=4, temperature=0)
    assert answer.choices[0].text == "The sea is" + plain.choices[0].text
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        await sdk.completions.create(model=MODEL, prompt="The sea is", max_tokens=0)


async def test_a_harness_remote_tokenizer_finds_what_it_reads(cluster: Cluster) -> None:
    """What lm-evaluation-harness's remote tokenizer asks before scoring: `/tokenizer_info` with an
    `eos_token`, `/tokenize` without special tokens (the end token reads as its one id), `/detokenize`."""
    async with httpx.AsyncClient(base_url=cluster.url, timeout=30) as http:
        info = (await http.get("/tokenizer_info")).json()
        assert info["eos_token"] and info["tokenizer_class"].startswith("llama.cpp/")
        assert "im_start" in info["chat_template"] and info["model_max_length"] == 512 and info["vocab_size"] > 1000
        eos = (await http.post("/tokenize", json={"prompt": info["eos_token"], "add_special_tokens": False})).json()
        assert eos["count"] == 1
        words = (await http.post("/tokenize", json={"prompt": " blue", "add_special_tokens": False})).json()
        back = (await http.post("/detokenize", json={"tokens": words["tokens"]})).json()
        assert back["prompt"] == " blue"
