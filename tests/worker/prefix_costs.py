"""The measurements behind the worker's prefix cache: `python -m tests.worker.prefix_costs` (not a test).

Owns: three measurements with the real SmolLM2 model, printed as tables (docs/benchmarks.md, "Worker
prefix cache"):
  1. decode   llama_decode time of one step (one token for each of N sequences holding L tokens), in
              the worker's split context (16 x 2048 cells) and its unified one (16 x 1024 cells,
              settings' default), interleaved, median of the repetitions. Independent requests: what
              a unified cache costs them, attending over every sequence's cells.
  2. copy     split KV: llama_memory_seq_cp across streams (llama.cpp copies the whole per-sequence
              buffer at the next decode) against prefilling a prefix: what `prefix_min_tokens` weighs.
  3. shared   a real worker per mode (split, unified, prompt cache off): one request with a ~400-token
              system prompt kept as a session, then 4 more with the same system prompt and their own
              question, one after another: prompt tokens reused, time to first token, KV held by the 5
              kept sessions, and whether each mode's greedy answers equal the others'.
Must not: run inside pytest (file name without `test_`), or run beside another measurement: wrap it in
`flock /tmp/bench.lock` like every benchmark here.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from collections.abc import Callable
from typing import Any

import llama_cpp as ll

from tests.sse import generate
from tests.worker.server import running_worker
from worker.engine import Engine, EngineConfig
from worker.model import Model
from worker.provision import DEFAULT_MODEL_PATH

SESSIONS, SESSION_TOKENS = 16, 2048  # the worker's defaults
STORY = ("Once upon a time in a small village by the sea there lived an old fisherman who told stories "
         "about the lighthouse, the storms, the ships that came and went, and the people who waited "
         "for them on the shore every evening when the sun went down behind the hills. ")
SYSTEM = "You are the village's storyteller. Here is what the village remembers. " + STORY * 9
QUESTIONS = ("Who told the stories?", "What did the people wait for?", "Where was the village?",
             "When did the sun go down?", "What came and went?")


class Ctx:
    """An `Engine` used only for `Engine.call`: llama.cpp's context as the worker builds it."""

    def __init__(self, model: Model, *, unified: bool, threads: int) -> None:
        ctx = SESSIONS * (SESSION_TOKENS // 2 if unified else SESSION_TOKENS)  # WorkerSettings._derive
        self.engine = Engine(model, EngineConfig(ctx_size=ctx, max_sessions=SESSIONS, threads=threads,
                                                 kv_unified=unified))
        self.loop = asyncio.new_event_loop()
        self.engine.start(self.loop)

    def call(self, fn: Callable[[Any], Any]) -> Any:
        return self.engine.call(fn).result(timeout=600)

    def close(self) -> None:
        self.engine.stop()
        self.loop.close()


def put(rows: list[tuple[int, int, int, bool]]) -> Callable[[Any], float]:
    """For `Engine.call`: decodes (token, position, seq_id, logits) rows in one llama_decode; seconds."""
    def run(ctx: Any) -> float:
        batch = ll.llama_batch_init(len(rows), 0, 1)
        try:
            for i, (token, pos, seq_id, logits) in enumerate(rows):
                batch.token[i], batch.pos[i], batch.n_seq_id[i] = token, pos, 1
                batch.seq_id[i][0], batch.logits[i] = seq_id, logits
            batch.n_tokens = len(rows)
            started = time.perf_counter()
            assert ll.llama_decode(ctx, batch) == 0
            return time.perf_counter() - started
        finally:
            ll.llama_batch_free(batch)
    return run


def prefill(ctx: Ctx, seq_id: int, tokens: list[int], start: int = 0, chunk: int = 256) -> float:
    spent = 0.0
    for offset in range(0, len(tokens), chunk):
        part = tokens[offset:offset + chunk]
        spent += ctx.call(put([(t, start + offset + i, seq_id, offset + i == len(tokens) - 1)
                               for i, t in enumerate(part)]))
    return spent


def fresh(ctx: Ctx, seq_id: int, tokens: list[int]) -> float:
    ctx.call(cut(seq_id, 0))
    return prefill(ctx, seq_id, tokens)


def cut(seq_id: int, keep: int) -> Callable[[Any], bool]:
    return lambda c: bool(ll.llama_memory_seq_rm(ll.llama_get_memory(c), seq_id, keep, -1))


def step_ms(ctx: Ctx, n: int, length: int, steps: int, token: int) -> list[float]:
    """Times `steps` decode steps of one token per sequence 0..n-1 (each holding `length` tokens), then
    cuts the sequences back to `length`."""
    times = [ctx.call(put([(token, length + k, s, True) for s in range(n)])) * 1e3 for k in range(steps)]
    for s in range(n):
        ctx.call(cut(s, length))
    return times


def measure_decode(model: Model, threads: int, reps: int, lengths: tuple[int, ...], n: int) -> None:
    tokens = model.tokenize(STORY * 40, add_special=True)
    ctxs = {"split": Ctx(model, unified=False, threads=threads), "unified": Ctx(model, unified=True, threads=threads)}
    try:
        print(f"\n1. decode: one llama_decode of {n} sequences x 1 token, median of {reps} x 8 steps "
              f"per mode, interleaved")
        print(f"   {'tokens held per sequence':>26} {'split ms':>9} {'unified ms':>11} {'unified / split':>16}")
        held = 0
        for length in lengths:
            for ctx in ctxs.values():
                for s in range(n):
                    prefill(ctx, s, tokens[held:length], held)
            held = length
            samples: dict[str, list[float]] = {name: [] for name in ctxs}
            for _ in range(reps):
                for name, ctx in ctxs.items():
                    samples[name] += step_ms(ctx, n, length, 8, tokens[length])
            split, unified = (statistics.median(samples[k]) for k in ("split", "unified"))
            print(f"   {length:>26} {split:9.1f} {unified:11.1f} {unified / split:16.2f}")
    finally:
        for ctx in ctxs.values():
            ctx.close()


def measure_copy(model: Model, threads: int, reps: int) -> None:
    tokens = model.tokenize(STORY * 12, add_special=True)
    ctx = Ctx(model, unified=False, threads=threads)
    try:
        prefill(ctx, 0, tokens[:512])

        def one(seq_id: int, at: int) -> float:
            return ctx.call(put([(tokens[at], at, seq_id, True)]))

        def copied(n: int) -> Callable[[Any], None]:
            def run(c: Any) -> None:
                mem = ll.llama_get_memory(c)
                ll.llama_memory_seq_rm(mem, 5, -1, -1)
                ll.llama_memory_seq_cp(mem, 0, 5, -1, -1)
                ll.llama_memory_seq_rm(mem, 5, n, -1)
            return run

        plain, with_copy = [], []
        for _ in range(reps):
            ctx.call(cut(5, 0))
            plain.append(one(5, 0))
            ctx.call(copied(256))
            with_copy.append(one(5, 256))
        base, copy = statistics.median(plain) * 1e3, statistics.median(with_copy) * 1e3
        mib = SESSION_TOKENS * model.bytes_per_token / 2**20
        print(f"\n2. copy (split KV, {SESSION_TOKENS} cells = {mib:.0f} MiB per sequence), median of {reps}")
        print(f"   1-token decode {base:.1f} ms; after a cross-stream seq_cp {copy:.1f} ms: the copy costs "
              f"{copy - base:.1f} ms")
        for n in (16, 32, 64, 256):
            spent = statistics.median(fresh(ctx, 6, tokens[:n]) for _ in range(max(1, reps // 4)))
            print(f"   prefill of {n:3d} tokens: {spent * 1e3:7.1f} ms ({spent * 1e3 / n:.2f} ms/token): "
                  f"{(copy - base) / (spent * 1e3):.2f} of it for a copy")
    finally:
        ctx.close()


def measure_shared(threads: int) -> None:
    modes: dict[str, dict[str, Any]] = {"split": {}, "unified": {"kv_unified": True},
                                        "no cache": {"prompt_cache": False}}
    print("\n3. shared: a kept session holds a ~400-token system prompt; 4 requests with the same system prompt "
          "follow, one at a time (medians of the 4)")
    print(f"   {'mode':<9} {'prompt':>6} {'reused':>6} {'TTFT ms':>8} {'KV of 5 sessions MiB':>21}  answers")
    texts: dict[str, list[str]] = {}
    for name, extra in modes.items():
        with running_worker(DEFAULT_MODEL_PATH, threads=threads, max_sessions=8, session_max_tokens=1024,
                            **extra) as worker:
            done, texts[name] = [], []
            for i, question in enumerate(QUESTIONS):
                stream = generate(worker.url, {"messages": [{"role": "system", "content": SYSTEM},
                                                            {"role": "user", "content": question}],
                                               "session_id": f"s{i}", "max_tokens": 16, "temperature": 0},
                                  timeout=300)
                assert stream.last[0] == "done", stream.events[-1:]
                done.append(stream.last[1])
                texts[name].append(stream.text)
            kv = worker.load()["kv_used_bytes"] / 2**20
        later = done[1:]
        same = texts[name] == texts["split"]
        print(f"   {name:<9} {statistics.median(d['usage']['prompt_tokens'] for d in later):6.0f} "
              f"{statistics.median(d['usage']['cached_tokens'] for d in later):6.0f} "
              f"{statistics.median(d['timings']['ttft_ms'] for d in later):8.1f} {kv:21.1f}  "
              f"{'same as split' if same else 'DIFFER from split'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--sequences", type=int, default=16)
    parser.add_argument("--lengths", default="80,400", help="tokens each sequence holds, ascending")
    parser.add_argument("--only", default="decode,copy,shared")
    args = parser.parse_args()
    parts = args.only.split(",")
    model = Model(DEFAULT_MODEL_PATH)
    try:
        if "decode" in parts:
            measure_decode(model, args.threads, args.reps, tuple(int(x) for x in args.lengths.split(",")),
                           args.sequences)
        if "copy" in parts:
            measure_copy(model, args.threads, args.reps * 4)
    finally:
        model.close()
    if "shared" in parts:
        measure_shared(args.threads)


if __name__ == "__main__":
    main()
