"""What every engine backend offers, and the types they share: nothing here imports llama.cpp.

Owns: `ModelBackend` (what the edge needs of a model: its name and KV size, tokenizing, the chat
template), `EngineBackend` (what the runtime and the edge need of every engine: submit a job, free
and cancel sessions, its sizes and counts), the optional capabilities `KvTransfer`, `PrefixExport` and
`Preemption` (checked at start with `isinstance`), and the model-neutral `ModelShape`. (What the embedder
needs is `worker.engine.embedder.EmbeddingContext`; a turn of a chat is `worker.sessions.messages.Message`.)
Must not: hold behaviour. The real backend is llama.cpp (`llama_model`, `llama_engine`); the
simulated one (`simulated`) stands behind the same protocols for coordinator-scale benchmarks.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol, TypeVar, runtime_checkable

from protocol.worker import ToolUse

if TYPE_CHECKING:
    import concurrent.futures

    from worker.backends.tool_format import ToolFormat
    from worker.engine.jobs import Job
    from worker.engine.sampling import Constraint
    from worker.sessions.messages import Message
    from worker.sessions.table import Session, SessionTable
    from worker.sessions.transfer import Origin


T = TypeVar("T")

# No chat template in the GGUF (a base model): plain `role: text` turns, so chat requests still work,
# and the next `user:` turn the model starts to write ends the answer.
PLAIN_TURN_STOP = "\nuser:"


def plain_turns(turns: Sequence[Mapping[str, Any]]) -> str:
    return "".join(f"{t['role']}: {t['content']}\n" for t in turns) + "assistant:"


@dataclass(frozen=True)
class ModelShape:
    n_layer: int
    n_head: int
    n_head_kv: int
    n_embd: int
    head_dim_k: int
    head_dim_v: int
    n_ctx_train: int
    n_vocab: int
    n_swa: int = 0  # sliding-window attention span of the layers that use one (Gemma 3: 512); 0: none

    def kv_bytes_per_token(self, element_bytes: int) -> int:
        """K and V rows of every layer for one token: layers x KV heads x (K dim + V dim) x element size.

        This is the worker's, and the coordinator's, whole contract: a sequence of n tokens holds
        exactly n x this many KV bytes, and the context holds ctx_tokens x this many. It is exact
        because every layer keeps every token of a sequence. For sliding-window models (n_swa > 0)
        that holds only because the engine creates its context with `swa_full` (llama.cpp's
        full-size SWA cache): the windowed layers then get as many cells as the global ones and
        keep the tokens that fell out of their window. Without it llama.cpp gives those layers a
        ring of about window + batch cells per sequence (`iSWA`), so the real cost of a sequence
        would be n on the global layers plus min(n, ring) on the windowed ones: not linear, and
        worse, a new turn that cuts a session back (`llama_memory_seq_rm` from `keep` on) past what
        the ring still holds would continue with part of its window silently gone. Keeping every
        token costs memory (on Gemma 3 270M with 15 of 18 layers windowed, ctx x 18 layers instead of
        ctx x 3 + ring x 15), and buys an exact linear count plus correct session continuation.

        llama.cpp's own `llama_state_seq_get_size` agrees up to a fixed header and a few bytes of
        cell metadata per token while n <= n_swa; past the window it serializes only the window of
        the windowed layers (all a restore needs), so it is then smaller than this count while the
        memory still holds every token.
        """
        return self.n_layer * self.n_head_kv * (self.head_dim_k + self.head_dim_v) * element_bytes



IDENTITY_SAMPLE = 1 << 20


def file_identity(path: Path) -> str:
    """A model file's identity, cheap at any size: a digest of its size, its first and its last MiB
    (the GGUF header and metadata, and the tail of its tensors). Two files that differ there are two
    models; the coordinator keys cached answers by it, so a model swapped under the same public name
    never answers with the old one's output."""
    digest = hashlib.blake2b(digest_size=16)
    size = path.stat().st_size
    digest.update(str(size).encode())
    with path.open("rb") as handle:
        digest.update(handle.read(IDENTITY_SAMPLE))
        handle.seek(max(0, size - IDENTITY_SAMPLE))
        digest.update(handle.read(IDENTITY_SAMPLE))
    return "gguf:" + digest.hexdigest()


@dataclass(frozen=True)
class SpecialTokens:
    """The tokenizer's facts a client needs besides its tokens (`GET /tokenizer_info`)."""

    kind: str  # the GGUF's tokenizer model: gpt2, llama, ...
    bos: str | None  # the begin-of-text token's text, None without one
    eos: str | None
    add_bos: bool  # a prompt tokenized with its special tokens starts with bos
    chat_template: str | None


class ModelBackend(Protocol):
    """A loaded model, as the edge and the runtime use it."""

    name: str
    max_token_bytes: int  # the most UTF-8 bytes one token of the vocabulary covers
    identity: str  # what the model is, beyond its public name (heartbeats carry it; `file_identity`)
    bytes_per_token: int
    shape: ModelShape
    eog_tokens: tuple[int, ...]
    backend: str  # "cpu", "cuda", ...: what /worker/health reports
    gpu_layers: int

    @property
    def turn_stop(self) -> str | None: ...
    @property
    def tool_format(self) -> ToolFormat:
        """How this model is told about tools, and what holds its calls (worker/backends/tool_format.py)."""
        ...
    def tokenize(self, text: str, *, add_special: bool) -> list[int]: ...
    def piece(self, token: int) -> bytes:
        """One token's bytes (maybe part of a UTF-8 character; a special token's are empty)."""
        ...
    def render_chat(self, messages: list[Message], tools: ToolUse | None = None) -> str:
        """The conversation (with the request's tools, in this model's tool format), the assistant's
        turn opened."""
        ...
    def constraint(self, *, grammar: str | None, json_schema: dict[str, Any] | None,
                   lazy: bool = False) -> Constraint | None:
        """The request's grammar compiled for this model (`ConstraintError` when it cannot be); `lazy`:
        only for an answer that starts as the grammar does (worker/engine/grammar.py's `LazyGrammar`)."""
        ...
    def meta_str(self, key: str) -> str | None: ...
    def special_tokens(self) -> SpecialTokens: ...
    def close(self) -> None: ...


class EngineBackend(Protocol):
    """An engine that runs admitted jobs and streams their items to each job's channel, ending each
    by the shared rules (worker/engine/endings.py)."""

    table: SessionTable | None
    steps: int

    @property
    def ctx_tokens(self) -> int: ...
    @property
    def seq_tokens(self) -> int: ...
    @property
    def queue_depth(self) -> int: ...
    @property
    def running(self) -> int: ...
    @property
    def active(self) -> int: ...
    def bind(self, table: SessionTable) -> None: ...
    def start(self, loop: Any) -> None: ...
    def stop(self, timeout: float = 5.0) -> None: ...
    def submit(self, job: Job, free_first: tuple[int, ...] = ()) -> None: ...
    def free(self, seq_ids: list[int] | tuple[int, ...]) -> None: ...
    def cancel_session(self, session: Session) -> None: ...
    def poke(self) -> None: ...


@runtime_checkable
class KvTransfer(Protocol):
    """A capability an engine may have: its sequences' cells leave and arrive as bytes (a session
    exported, imported, or moved off a draining worker). The runtime looks for it at start; an engine
    without it answers those routes 400 and is never asked for a peer's prefix."""

    def cells_origin(self) -> Origin:
        """What this engine's cells are (model, KV type, llama.cpp build): KV blobs move only between equals."""
        ...
    def export_cells(self, seq_id: int) -> concurrent.futures.Future[bytes]:
        """One sequence's cells, as bytes another engine of the same origin can take in."""
        ...
    def import_cells(self, seq_id: int, cells: bytes | memoryview, keep: int | None = None
                     ) -> concurrent.futures.Future[int]:
        """Writes exported cells into `seq_id` (its first `keep` positions only, when given): the
        positions it then holds, 0 when refused (left empty)."""
        ...


@runtime_checkable
class Preemption(Protocol):
    """A capability an engine may have: a running batch request parks (its cells to host memory, its
    sequence freed) for an interactive one, and resumes where it stopped when a sequence is free."""

    @property
    def parkable(self) -> int:
        """Batch requests running now that `park` could park."""
        ...
    def park(self, then: Callable[[], T]) -> concurrent.futures.Future[T | None]:
        """Parks one, frees its sequence and calls `then` (an admission) before any parked request can
        take the sequence back: what `then` returns or raises; None when none could be parked."""
        ...


@runtime_checkable
class PromptScoring(Protocol):
    """A capability an engine may have: it scores a prompt's own tokens from its prefill's logits
    (`GenerateRequest.prompt_logprobs`: `echo` with `logprobs`). A worker whose engine has not
    refuses such a request with 400."""

    def scores_prompts(self) -> Literal[True]:
        """Says so (the capability is this method's presence)."""
        ...


@runtime_checkable
class PrefixExport(KvTransfer, Protocol):
    """A capability beyond `KvTransfer`: the cells of the sequence holding a prompt's prefix, for a peer
    worker that would otherwise prefill it (`POST /worker/prefix`)."""

    def export_prefix(self, prompt: list[int], tenant: str, at_least: int
                      ) -> concurrent.futures.Future[tuple[list[int], bytes] | None]:
        """The cells of the sequence holding the longest prefix of `tenant`'s `prompt` (at least
        `at_least` tokens), with what they hold; None when no sequence does."""
        ...
