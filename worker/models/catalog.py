"""The models in a folder as a worker would offer them (issue 37): each GGUF named as a worker names the
model it loads, its shape read from its header, and what it needs to be served: its weights plus the
KV cache of its sessions, against a memory budget.

Owns: `scan` (every `*.gguf` in a folder, in name order, at most MAX_FILES; a name two files would
share goes to the first, the second is named from its file's stem) and `Offer`, one file's
verdict: `offered` with its names, identity and memory need; or `unavailable` with the reason (not a
GGUF this worker reads, a header without the keys a shape needs, an architecture none of whose keys
are there) or `too_large` (its need past the budget, both named). Nothing is loaded.
Must not: load weights (llama.cpp does, when a model is asked for), or decide what is loaded when.

The memory need is the file's size (the weights, mapped as they are) plus `sessions x session_tokens`
tokens of KV at `ModelShape.kv_bytes_per_token`: what a worker's context for the model holds, as the
worker sizes it from its settings today.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal

from protocol.health import MAX_OFFERED
from worker.backends.base import ModelShape, file_identity
from worker.models.gguf import GgufError, GgufHeader, read_header
from worker.naming import ModelNames, derive_name

MAX_FILES = MAX_OFFERED  # GGUF files one folder may offer (a heartbeat lists them all); the rest are not read
State = Literal["offered", "unavailable", "too_large"]


@dataclass(frozen=True)
class Offer:
    path: Path
    state: State
    names: ModelNames | None = None  # its name and aliases, as a worker loading it would serve it
    identity: str = ""  # the file's identity digest (worker.backends.base.file_identity)
    shape: ModelShape | None = None
    weight_bytes: int = 0
    kv_bytes: int = 0  # the KV cache of its sessions
    reason: str = ""  # why it is not offered
    stamp: tuple[int, int, int] = (0, 0, 0)  # its file's inode, size and modification time when judged

    @property
    def need_bytes(self) -> int:
        return self.weight_bytes + self.kv_bytes


@dataclass(frozen=True)
class Sizing:
    """What the worker would give each model it loads (its settings), and the memory they may take."""

    sessions: int
    session_tokens: int
    kv_element_bytes: int = 2  # f16 K and V
    budget_bytes: int | None = None  # None: no limit


def scan(folder: Path, sizing: Sizing, judged: dict[Path, Offer] | None = None) -> list[Offer]:
    """Every `*.gguf` in `folder` (not in its subfolders), in name order, with its verdict. `judged`: the
    verdicts of an earlier scan, by path, which it updates: a file whose inode, size and modification
    time are unchanged keeps its verdict, unread (at most MAX_FILES entries, the files of this scan)."""
    files = sorted(p for p in folder.glob("*.gguf") if p.is_file())
    offers: list[Offer] = []
    taken: set[str] = set()
    fresh: dict[Path, Offer] = {}
    for path in files[:MAX_FILES]:
        found = fresh[path] = _judged(path, sizing, judged or {})
        if found.names is not None and found.names.name in taken:  # two quantizations of one model, say
            stem = derive_name(None, path.stem)
            renamed = ModelNames(stem, tuple(a for a in found.names.aliases if a != stem))
            found = replace(found, names=renamed) if stem not in taken else replace(
                found, state="unavailable", names=None, reason=f"its name {found.names.name!r} is another file's")
        if found.names is not None:
            taken.add(found.names.name)
        offers.append(found)
    if judged is not None:
        judged.clear()
        judged.update(fresh)
    return offers


def stamp_of(path: Path) -> tuple[int, int, int]:
    """What changes when a file is replaced (its inode) or written over (its size, its modification
    time); (0, 0, 0) when it cannot be read."""
    try:
        st = path.stat()
    except OSError:
        return 0, 0, 0
    return st.st_ino, st.st_size, st.st_mtime_ns


def _judged(path: Path, sizing: Sizing, before: dict[Path, Offer]) -> Offer:
    stamp = stamp_of(path)
    known = before.get(path)
    if known is not None and known.stamp == stamp != (0, 0, 0):
        return known
    return replace(offer(path, sizing), stamp=stamp)


def offer(path: Path, sizing: Sizing) -> Offer:
    """One file's verdict."""
    try:
        header = read_header(path)
        shape = shape_of(header)
    except GgufError as exc:
        return Offer(path, "unavailable", reason=str(exc))
    except OSError as exc:
        return Offer(path, "unavailable", reason=f"cannot be read: {exc.strerror or exc}")
    names = ModelNames.choose(configured="", configured_aliases=(), general_name=header.str_of("general.name"),
                              file_stem=path.stem)
    weights = path.stat().st_size
    kv = sizing.sessions * sizing.session_tokens * shape.kv_bytes_per_token(sizing.kv_element_bytes)
    found = Offer(path, "offered", names, file_identity(path), shape, weights, kv)
    if sizing.budget_bytes is not None and found.need_bytes > sizing.budget_bytes:
        return Offer(path, "too_large", names, found.identity, shape, weights, kv,
                     reason=f"needs {found.need_bytes:,} bytes ({weights:,} of weights, {kv:,} of KV for "
                            f"{sizing.sessions} sessions of {sizing.session_tokens} tokens); the budget is "
                            f"{sizing.budget_bytes:,}")
    return found


def shape_of(header: GgufHeader) -> ModelShape:
    """The model's shape from its header's `<architecture>.*` keys (`GgufError` naming a missing one)."""
    arch = header.str_of("general.architecture")
    if not arch:
        raise GgufError("no general.architecture in its header")

    def need(key: str) -> int:
        value = header.int_of(f"{arch}.{key}")
        if value is None or value <= 0:
            raise GgufError(f"no {arch}.{key} in its header (a per-layer list is not read)")
        return value

    n_embd, n_head = need("embedding_length"), need("attention.head_count")
    n_vocab = header.arrays.get("tokenizer.ggml.tokens")
    if not n_vocab:
        raise GgufError("no tokenizer.ggml.tokens in its header")
    return ModelShape(
        n_layer=need("block_count"), n_head=n_head,
        n_head_kv=header.int_of(f"{arch}.attention.head_count_kv") or n_head, n_embd=n_embd,
        head_dim_k=header.int_of(f"{arch}.attention.key_length") or n_embd // n_head,
        head_dim_v=header.int_of(f"{arch}.attention.value_length") or n_embd // n_head,
        n_ctx_train=need("context_length"), n_vocab=n_vocab,
        n_swa=header.int_of(f"{arch}.attention.sliding_window") or 0)
