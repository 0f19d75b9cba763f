"""A kept session's KV as bytes that another worker of the same model can take in: the blob's format,
its checks, and its bounds.

Owns: writing a blob (`pack`: a header naming the model, the KV element type, the llama.cpp build that
wrote the cells, the session's tokens and chat history, and a digest of the cells) and reading one
back (`unpack`), refusing anything that would not land as the same cells: another model or KV type,
another llama.cpp (its state layout is not a stable format), a blob cut short, a byte flipped, a
header past its bounds, a token id outside the vocabulary. Every refusal is a `TransferRefused` naming what is wrong.
Must not: touch llama.cpp or the session table; the engine reads and writes the cells
(`EngineBackend.export_cells` / `import_cells`) and the routes hold the table's side
(worker/api/transfer.py).

The layout: `MAGIC`, a 4-byte little-endian header length, the header (JSON), then the cells exactly
as `llama_state_seq_get_data` wrote them (`state_bytes` of them, digest `blake2b-256`).
"""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from protocol.worker import ChatMessage

MAGIC = b"LLMPOOL-KV\n"
FORMAT = 1
MAX_HEADER_BYTES = 16 << 20  # tokens and the chat history; a session's text is far below this
_LENGTH = struct.Struct("<I")


class TransferRefused(ValueError):
    """The blob cannot become this worker's cells; the message says why (for a 400)."""


class KvHeader(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    format: int
    model_identity: str = Field(max_length=256)
    kv_type: int
    llama_cpp: str = Field(max_length=64, description="the llama.cpp build (llama-cpp-python's version) that "
                                                     "wrote the cells")
    tokens: list[int] = Field(max_length=1 << 20)
    messages: list[ChatMessage] = Field(default_factory=list, max_length=1 << 16)
    state_bytes: int = Field(ge=0)
    digest: str = Field(max_length=128)


@dataclass(frozen=True, slots=True)
class Origin:
    """What a worker's cells are: a blob lands only where all of it is the same."""

    model_identity: str
    kv_type: int
    llama_cpp: str
    n_vocab: int = 0  # the model's tokens: a blob's token ids must be below it (0: not checked)


def pack(origin: Origin, tokens: list[int], messages: list[ChatMessage], cells: bytes) -> bytes:
    header = KvHeader(format=FORMAT, model_identity=origin.model_identity, kv_type=origin.kv_type,
                      llama_cpp=origin.llama_cpp, tokens=tokens, messages=messages, state_bytes=len(cells),
                      digest=hashlib.blake2b(cells, digest_size=32).hexdigest())
    text = header.model_dump_json().encode()
    return MAGIC + _LENGTH.pack(len(text)) + text + cells


def split(blob: bytes) -> tuple[KvHeader, memoryview]:
    """A blob's header and cells, as written; `TransferRefused` when it is no blob of this format."""
    view = memoryview(blob)
    start = len(MAGIC) + _LENGTH.size
    if len(view) < start or bytes(view[:len(MAGIC)]) != MAGIC:
        raise TransferRefused("not a KV blob of this pool (its first bytes are wrong)")
    (size,) = _LENGTH.unpack_from(view, len(MAGIC))
    if size > MAX_HEADER_BYTES or start + size > len(view):
        raise TransferRefused("the blob's header is cut short or past its bound")
    try:
        header = KvHeader.model_validate(json.loads(bytes(view[start:start + size])))
    except (ValueError, ValidationError) as exc:
        raise TransferRefused(f"the blob's header cannot be read: {str(exc)[:200]}") from None
    if header.format != FORMAT:
        raise TransferRefused(f"blob format {header.format}; this worker reads format {FORMAT}")
    return header, view[start + size:]


def unpack(blob: bytes, origin: Origin, *, max_tokens: int) -> tuple[KvHeader, memoryview]:
    """The header and the cells of a blob this worker can take in, or `TransferRefused`."""
    header, cells = split(blob)
    for name, theirs, ours in (("model", header.model_identity, origin.model_identity),
                               ("KV element type", header.kv_type, origin.kv_type),
                               ("llama.cpp build", header.llama_cpp, origin.llama_cpp)):
        if theirs != ours:
            raise TransferRefused(f"the blob's {name} is {theirs!r}, this worker's {ours!r}")
    if not 1 <= len(header.tokens) <= max_tokens:
        raise TransferRefused(f"the blob holds {len(header.tokens)} tokens; a session here holds 1 to {max_tokens}")
    if origin.n_vocab and (bad := next((t for t in header.tokens if not 0 <= t < origin.n_vocab), None)) is not None:
        # The tokens become the session's history: a next turn's prompt cache and the prefix index
        # compare against them, and a detokenizer would read past the vocabulary.
        raise TransferRefused(f"the blob holds token id {bad}, outside this model's vocabulary (0 to "
                              f"{origin.n_vocab - 1})")
    if len(cells) != header.state_bytes:
        raise TransferRefused(f"the blob's cells are {len(cells)} bytes, its header says {header.state_bytes}")
    if hashlib.blake2b(cells, digest_size=32).hexdigest() != header.digest:
        raise TransferRefused("the blob's cells do not match their digest (damaged in transit?)")
    return header, cells
