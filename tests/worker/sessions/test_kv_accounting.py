"""The worker's KV accounting against llama.cpp's own numbers, on SmolLM2 and on Gemma 3 270M.

Gemma 3 uses sliding-window attention (a 512-token window) on 15 of its 18 layers, which llama.cpp
keeps in a separate, smaller "iSWA" cache unless the context asks for `swa_full`. These tests build
the engine's context exactly as the worker does and check, for sequences shorter and longer than the
window, that `tokens x bytes_per_token` is what llama.cpp really holds, and that a session can be cut
back (`llama_memory_seq_rm` from a position on, as the engine does for a new turn) and continued with
the same logits as a sequence decoded from scratch.
"""

from __future__ import annotations

import asyncio
import ctypes
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import llama_cpp as ll
import numpy as np
import pytest

from tests.conftest import MODEL_THREADS
from tests.sse import generate
from tests.worker.server import running_worker, shared_model
from worker.backends.llama_engine import Engine, EngineConfig, state_seq_size
from worker.backends.llama_model import Model

pytestmark = pytest.mark.model

LENGTHS = (10, 100, 600, 1500)  # 600 and 1500 are past Gemma's 512-token window
SHORT_LENGTHS = (10, 100, 300)  # a model without a window: nothing past 512 tokens differs
SESSION_TOKENS = 2048
MAX_SESSIONS = 4
CHUNK = 256  # the worker's default prefill chunk
TEXT = ("Once upon a time in a small village by the sea there lived an old fisherman who told stories "
        "about the lighthouse, the storms, the ships that came and went, and the people who waited "
        "for them on the shore every evening when the sun went down behind the hills. ")


@pytest.fixture(scope="module", params=["smollm2", "gemma3"])
def any_model(request: pytest.FixtureRequest) -> Model:
    """The process's one load of each model (`shared_model`), which the Gemma tests below and the
    in-thread worker share: each engine makes a context of its own."""
    return shared_model(request.getfixturevalue("model_path" if request.param == "smollm2" else "gemma_path"))


# -- the engine's context, as the worker builds it ------------------------------------------------------


@dataclass
class KvCache:
    """One `llama_kv_cache` as llama.cpp reports it when it allocates the context."""

    mib: float  # K + V buffers
    cells: int  # per stream
    layers: int
    streams: int  # one per sequence when split, one when unified

    @property
    def cell_layers(self) -> int:
        return self.cells * self.streams * self.layers


_KV_LINE = re.compile(r"llama_kv_cache: size = \s*([\d.]+) MiB \(\s*(\d+) cells,\s*(\d+) layers,\s*\d+/(\d+) seqs\)")


@dataclass
class BuiltEngine:
    engine: Engine
    caches: list[KvCache]
    loop: asyncio.AbstractEventLoop

    def call(self, fn: Callable[[Any], Any]) -> Any:
        return self.engine.call(fn).result(timeout=600)

    def close(self) -> None:
        self.engine.stop()
        self.loop.close()


def build_engine(model: Model, *, kv_unified: bool, max_sessions: int = MAX_SESSIONS) -> BuiltEngine:
    """`Engine(model, config)` with the worker's defaults (2 threads here: both cores), capturing llama.cpp's
    INFO lines about the KV caches it allocates while the context is made."""
    lines: list[str] = []

    def capture(level: int, text: bytes, _user: ctypes.c_void_p) -> None:
        lines.append(text.decode("utf-8", errors="replace"))

    callback = ll.llama_log_callback(capture)
    ll.llama_log_set(callback, ctypes.c_void_p(0))
    try:
        config = EngineConfig(ctx_size=max_sessions * SESSION_TOKENS, max_sessions=max_sessions, threads=MODEL_THREADS,
                              prefill_chunk=CHUNK, kv_unified=kv_unified)
        engine = Engine(model, config)
    finally:
        from worker.backends import llama_model as model_module
        ll.llama_log_set(model_module._LLAMA_LOG_CALLBACK, ctypes.c_void_p(0))
    caches = [KvCache(float(m[1]), int(m[2]), int(m[3]), int(m[4])) for m in map(_KV_LINE.search, "".join(lines).splitlines()) if m]
    loop = asyncio.new_event_loop()  # the engine wakes channels through it; these tests use none
    engine.start(loop)
    return BuiltEngine(engine, caches, loop)


def decode(seq_id: int, tokens: list[int], start: int) -> Callable[[Any], np.ndarray]:
    """For `Engine.call`: puts `tokens` at positions start.. of `seq_id` in prefill-sized chunks;
    returns the logits of the last one."""
    def run(ctx: Any) -> np.ndarray:
        batch = ll.llama_batch_init(CHUNK, 0, 1)
        try:
            for offset in range(0, len(tokens), CHUNK):
                part = tokens[offset:offset + CHUNK]
                for i, token in enumerate(part):
                    batch.token[i] = token
                    batch.pos[i] = start + offset + i
                    batch.n_seq_id[i] = 1
                    batch.seq_id[i][0] = seq_id
                    batch.logits[i] = offset + i == len(tokens) - 1
                batch.n_tokens = len(part)
                status = ll.llama_decode(ctx, batch)
                assert status == 0, f"llama_decode returned {status}"
            n_vocab = ll.llama_vocab_n_tokens(ll.llama_model_get_vocab(ll.llama_get_model(ctx)))
            return np.ctypeslib.as_array(ll.llama_get_logits_ith(ctx, len(part) - 1), shape=(n_vocab,)).copy()
        finally:
            ll.llama_batch_free(batch)
    return run


def positions(seq_id: int) -> Callable[[Any], tuple[int, int]]:
    """For `Engine.call`: the lowest and highest position `seq_id` holds in every layer."""
    def run(ctx: Any) -> tuple[int, int]:
        mem = ll.llama_get_memory(ctx)
        return ll.llama_memory_seq_pos_min(mem, seq_id), ll.llama_memory_seq_pos_max(mem, seq_id)
    return run


def remove_from(seq_id: int, keep: int) -> Callable[[Any], bool]:
    """For `Engine.call`: what `Engine._begin` does before a new turn: drop every position >= keep."""
    return lambda ctx: bool(ll.llama_memory_seq_rm(ll.llama_get_memory(ctx), seq_id, keep, -1))


def tokens_of(model: Model, n: int) -> list[int]:
    tokens = model.tokenize(TEXT * (n // 20 + 1), add_special=True)
    assert len(tokens) >= n
    return tokens[:n]


@dataclass(frozen=True)
class Measured:
    n: int
    ours: int  # tokens x bytes_per_token: what the session table and the heartbeat say
    state: int  # llama_state_seq_get_size
    pos_min: int
    pos_max: int


def measure(built: BuiltEngine, model: Model, seq_id: int = 1) -> list[Measured]:
    """Grows one sequence through LENGTHS (SHORT_LENGTHS for a model without a sliding window) and
    reads llama.cpp's state size at each."""
    lengths = LENGTHS if model.shape.n_swa else SHORT_LENGTHS
    tokens = tokens_of(model, lengths[-1])
    rows, done = [], 0
    for n in lengths:
        built.call(decode(seq_id, tokens[done:n], done))
        done = n
        pos_min, pos_max = built.call(positions(seq_id))
        rows.append(Measured(n, n * model.bytes_per_token, built.call(state_seq_size(seq_id)), pos_min, pos_max))
    built.call(remove_from(seq_id, 0))
    return rows


# -- the tests ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kv_unified", [False, True], ids=["split", "unified"])
def test_bytes_per_token_is_exactly_what_llama_cpp_holds(any_model: Model, kv_unified: bool) -> None:
    built = build_engine(any_model, kv_unified=kv_unified)
    try:
        rows = measure(built, any_model)
        caches, ctx_tokens = built.caches, built.engine.ctx_tokens
    finally:
        built.close()
    bpt, n_layer = any_model.bytes_per_token, any_model.shape.n_layer
    # 1. Every layer keeps every token: the sequence still holds position 0 after its longest length (with
    #    a sliding-window cache it would keep only the last ~window+batch of them on 15 layers).
    for row in rows:
        assert (row.pos_min, row.pos_max) == (0, row.n - 1), f"{row}: llama.cpp dropped positions"
    # 2. The capacity the worker advertises (ctx_tokens x bytes_per_token) is the KV llama.cpp
    #    allocated: the caches' cells x layers add up to ctx_tokens x n_layer, nothing smaller.
    assert caches, "no 'llama_kv_cache: size = ...' line captured from llama.cpp"
    assert sum(c.cell_layers for c in caches) == ctx_tokens * n_layer, (caches, ctx_tokens)
    assert {c.cells * c.streams for c in caches} == {ctx_tokens}, caches
    assert abs(sum(c.mib for c in caches) * 2**20 - ctx_tokens * bpt) <= 0.01 * 2**20 * len(caches), caches
    # 3. llama.cpp's saved state of the sequence: a fixed header, then per token the K and V rows
    #    (exactly bytes_per_token) plus a few bytes of cell metadata (position, sequence ids).
    short = [r for r in rows if not any_model.shape.n_swa or r.n <= any_model.shape.n_swa]
    a, b = short[0], short[1]
    per_token = (b.state - a.state) / (b.n - a.n)
    meta = per_token - bpt
    assert meta == int(meta) and 0 <= meta <= 32, f"per token {per_token} B vs bytes_per_token {bpt} B"
    header = a.state - a.n * int(per_token)
    assert 0 < header < 4096, header
    for row in short:
        assert row.state == header + row.n * int(per_token), f"{row}: not linear in tokens"
    # Past the window llama.cpp saves only the window of the sliding layers (what a restore needs),
    # though it holds every token (1.): the state is then smaller than ours, never larger.
    for row in rows:
        assert row.state <= header + row.n * int(per_token), row


@pytest.mark.parametrize("kv_unified", [False, True], ids=["split", "unified"])
def test_gemma_session_continues_after_a_partial_seq_rm(gemma_path: Path, kv_unified: bool) -> None:
    """A new turn keeps a prefix of the session's KV and drops the rest, as `Engine._begin` does (an
    edited conversation can cut far back). Once the sequence has outgrown llama.cpp's sliding-window
    ring (window + batch cells per sequence when split, a shared ring of n_seq x window + batch when
    unified), the window before the cut would be gone and the continuation would silently attend to
    fewer tokens. With every token kept it gives, bit for bit, the logits of the same tokens decoded
    from scratch into the same cells."""
    model = shared_model(gemma_path)
    built = build_engine(model, kv_unified=kv_unified, max_sessions=2)
    try:
        # Past the ring llama.cpp would keep without swa_full (window x sequences + a batch, padded to
        # 256 cells): 1024 cells split, 1536 unified with 2 sequences; a ring would have written over
        # about the first 776 and 264 positions.
        total = min(built.engine.seq_tokens - 48, 1800)
        # A chunk boundary, so both paths decode the same chunks; the continuation attends to every
        # position before it, all of them ones a ring would have lost (at 3 chunks, as until 2026-11-29,
        # only 8 of its window when unified, and 512 more tokens to decode again).
        keep, upto = CHUNK, CHUNK + 32
        tokens = tokens_of(model, total)
        built.call(decode(0, tokens, 0))
        assert built.call(positions(0)) == (0, total - 1), "llama.cpp dropped positions of the session"
        assert built.call(remove_from(0, keep)), "llama.cpp refused to drop the tail of the sequence"
        assert built.call(positions(0)) == (0, keep - 1)
        continued = built.call(decode(0, tokens[keep:upto], keep))
        assert built.call(remove_from(0, 0))
        built.call(decode(0, tokens[:keep], 0))
        fresh = built.call(decode(0, tokens[keep:upto], keep))
    finally:
        built.close()
    gap = float(np.max(np.abs(continued - fresh)))
    assert gap <= 1e-4, f"the continued session differs from a fresh decode: max |logit gap| {gap:.4f}"


def test_gemma_second_turn_on_a_session(gemma_path: Path) -> None:
    """Through the worker's HTTP surface: a first turn past the window, a second turn on the same
    session prefills only its new tokens, and the session's KV is what the worker accounts."""
    story = TEXT * 20  # about 700 tokens: past the 512-token window
    with running_worker(gemma_path, threads=MODEL_THREADS, max_sessions=2, session_max_tokens=SESSION_TOKENS) as worker:
        first = generate(worker.url, {"prompt": story + "Who is the story about?", "session_id": "g",
                                      "max_tokens": 16, "temperature": 0}, timeout=300)
        assert first.last[0] == "done", first.events[-1:]
        session = worker.runtime.table.lookup("g")
        assert session is not None
        held = len(session.tokens)
        second = generate(worker.url, {"prompt": "And where does he live?", "session_id": "g",
                                       "max_tokens": 16, "temperature": 0}, timeout=300)
        assert second.last[0] == "done", second.events[-1:]
        u1, u2 = first.last[1]["usage"], second.last[1]["usage"]
        assert u1["prompt_tokens"] > worker.runtime.model.shape.n_swa > 0
        # Turn 1's prompt is reused; its reply may be re-read (it re-renders into other tokens), in
        # which case the engine cut the session back to `cached_tokens` before prefilling.
        assert u1["prompt_tokens"] <= u2["cached_tokens"] <= held, (u1, u2, held)
        new_turn = len(worker.runtime.model.tokenize("And where does he live?", add_special=False))
        assert u2["prompt_tokens"] - u2["cached_tokens"] <= new_turn + u1["completion_tokens"] + 12, (u1, u2)
        assert second.tokens, "the second turn produced nothing"
        session = worker.runtime.table.lookup("g")
        assert session is not None
        n = len(session.tokens)
        engine = worker.runtime.engine
        assert isinstance(engine, Engine)
        pos_min, pos_max = engine.call(positions(session.seq_id)).result(timeout=30)
        assert (pos_min, pos_max) == (0, n - 1), "the session's KV is not all of its tokens"
        listed = {s["session_id"]: s for s in httpx.get(worker.url + "/worker/sessions").json()["sessions"]}
        assert listed["g"]["kv_bytes"] == n * worker.runtime.model.bytes_per_token
