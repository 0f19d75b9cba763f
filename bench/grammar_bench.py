"""What a grammar costs: a JSON-schema-constrained stream against the same stream unconstrained, and
unconstrained streams beside a constrained one against the same streams alone, on one real worker.

Owns: the workload, the worker process it starts (the default model unless `--model`, `--threads`
llama.cpp threads) and the table it prints.
Must not: change worker code. Only 127.0.0.1 is used; the worker is stopped however the run ends.

    .venv/bin/python -m bench.grammar_bench [--runs 8] [--streams 8] [--tokens 64] [--threads 1]

Per-token time is the worker's own (`done.timings`: total less time to first token, over the tokens
after the first), so the HTTP side and the client are out of it; the runs alternate constrained and
not, and medians are printed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
from pathlib import Path
from typing import Any

import httpx

from bench.processes import free_port, peer_env, serving

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_MODEL = ROOT / "modelFiles" / "SmolLM2-135M-Instruct.Q4_1.gguf"
SCHEMA = {"type": "object", "required": ["name", "address"], "properties": {
    "name": {"type": "string", "maxLength": 40},
    "address": {"type": "object", "required": ["city", "zip"],
                "properties": {"city": {"type": "string", "maxLength": 40}, "zip": {"type": "integer"}}}}}
ASK = [{"role": "user", "content": "Give an example person with an address, as JSON."}]


async def stream(client: httpx.AsyncClient, url: str, tokens: int, constrained: bool) -> dict[str, Any]:
    body: dict[str, Any] = {"messages": ASK, "max_tokens": tokens, "temperature": 0}
    if constrained:
        body["json_schema"] = SCHEMA
    done: dict[str, Any] = {}
    async with client.stream("POST", url + "/worker/generate", json=body) as response:
        async for line in response.aiter_lines():
            if line.startswith("data: ") and '"finished":true' in line:
                done = json.loads(line[6:])
    if "usage" not in done:
        raise RuntimeError(f"no done event: {done}")
    return done


def per_token_ms(done: dict[str, Any]) -> float:
    n = done["usage"]["completion_tokens"]
    return (done["timings"]["total_ms"] - done["timings"]["ttft_ms"]) / max(1, n - 1)


async def measure(url: str, runs: int, streams: int, tokens: int) -> None:
    async with httpx.AsyncClient(timeout=120) as client:
        alone: dict[bool, list[float]] = {False: [], True: []}
        crowd: dict[bool, list[float]] = {False: [], True: []}
        for _ in range(runs):
            # The constrained answer ends when its JSON does: the unconstrained neighbour of the baseline
            # is cut to the same length, so both crowds shrink at the same step.
            shaped = await stream(client, url, tokens, True)
            length = shaped["usage"]["completion_tokens"]
            alone[True].append(per_token_ms(shaped))
            alone[False].append(per_token_ms(await stream(client, url, tokens, False)))
            for constrained in (False, True):
                # `streams` unconstrained streams, beside one more that is constrained or not.
                results = await asyncio.gather(stream(client, url, length, constrained),
                                               *(stream(client, url, tokens, False) for _ in range(streams)))
                crowd[constrained].append(statistics.median(per_token_ms(d) for d in results[1:]))
    a, c = ({k: statistics.median(v) for k, v in d.items()} for d in (alone, crowd))
    print(f"one stream alone, ms per token:             unconstrained {a[False]:6.2f}  "
          f"json_schema {a[True]:6.2f}  ({a[True] / a[False]:.2f}x)")
    print(f"{streams} unconstrained streams, ms per token:   beside an unconstrained one {c[False]:6.2f}  "
          f"beside a constrained one {c[True]:6.2f}  ({c[True] / c[False]:.2f}x; the neighbour as long either way)")


def micro(model_path: Path) -> None:
    """The two grammar operations on their own, in this process: checking one token, masking a row."""
    import time

    import numpy as np

    from worker.backends.llama_model import Model

    model = Model(model_path)
    grammar = model.constraint(grammar=None, json_schema=SCHEMA)
    assert grammar is not None
    (brace,) = model.tokenize("{", add_special=False)
    started = time.perf_counter()
    for _ in range(2_000):
        grammar.allows(brace)
    check_us = (time.perf_counter() - started) / 2_000 * 1e6
    row = np.random.default_rng(0).standard_normal(model.shape.n_vocab).astype(np.float32)
    out = np.empty_like(row)
    started = time.perf_counter()
    for _ in range(20):
        grammar.mask(row, out)
    mask_ms = (time.perf_counter() - started) / 20 * 1e3
    grammar.close()
    model.close()
    print(f"one token checked against the grammar: {check_us:.1f} us; a whole row of {row.size} masked: "
          f"{mask_ms:.2f} ms")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    parser.add_argument("--runs", type=int, default=8)
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    argv_ = [sys.executable, "-m", "worker", "--model-path", str(args.model), "--port", str(port),
             "--coordinator-url", "", "--threads", str(args.threads), "--max-sessions", str(args.streams + 1),
             "--log-level", "warning"]
    with serving("worker", argv_, url + "/worker/health", env=peer_env(None)):
        asyncio.run(measure(url, args.runs, args.streams, args.tokens))
    micro(args.model)
    return 0


if __name__ == "__main__":
    sys.exit(main())
