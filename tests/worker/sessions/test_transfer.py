"""The KV blob (worker/sessions/transfer.py): what it carries back, and every refusal naming its cause."""

from __future__ import annotations

import pytest

from protocol.worker import CalledFunction, ChatMessage
from worker.sessions.transfer import MAGIC, Origin, TransferRefused, pack, unpack

ORIGIN = Origin("gguf:abc", 1, "0.3.36", 1000)
CELLS = bytes(range(256)) * 40
TOKENS = [1, 5, 9, 13]
HISTORY = [ChatMessage(role="user", content="hi"),
           ChatMessage(role="assistant", content="", tool_calls=(CalledFunction(name="f", arguments="{}"),))]


def test_a_blob_gives_back_its_tokens_history_and_cells() -> None:
    header, cells = unpack(pack(ORIGIN, TOKENS, HISTORY, CELLS), ORIGIN, max_tokens=8)
    assert (header.tokens, header.messages, bytes(cells)) == (TOKENS, HISTORY, CELLS)


def _flip(blob: bytes, at: int) -> bytes:
    return blob[:at] + bytes([blob[at] ^ 1]) + blob[at + 1:]


BLOB = pack(ORIGIN, TOKENS, HISTORY, CELLS)


@pytest.mark.parametrize(("blob", "origin", "why"), [
    (_flip(BLOB, len(BLOB) - 1), ORIGIN, "digest"),  # a flipped byte in the cells
    (BLOB[:-10], ORIGIN, "cells are"),  # cut short
    (BLOB[:len(MAGIC) + 10], ORIGIN, "header is cut short"),
    (b"GET / HTTP/1.1\r\n" + BLOB, ORIGIN, "first bytes"),
    (BLOB, Origin("gguf:other", 1, "0.3.36", 1000), "model"),
    (BLOB, Origin("gguf:abc", 0, "0.3.36", 1000), "KV element type"),
    (BLOB, Origin("gguf:abc", 1, "0.3.37", 1000), "llama.cpp build"),
    (pack(ORIGIN, list(range(9)), [], CELLS), ORIGIN, "holds 9 tokens"),  # past the session limit
    (pack(ORIGIN, [], [], CELLS), ORIGIN, "holds 0 tokens"),
    (pack(ORIGIN, [1, 10**9, 3], [], CELLS), ORIGIN, "token id 1000000000, outside"),  # issue 33: accepted before
    (pack(ORIGIN, [1, -5], [], CELLS), ORIGIN, "token id -5, outside"),
    (pack(ORIGIN, [1, 1000], [], CELLS), ORIGIN, "token id 1000, outside"),
    (MAGIC + b"\x05\x00\x00\x00{bad}" + CELLS, ORIGIN, "header cannot be read"),
])
def test_a_blob_that_would_not_land_as_the_same_cells_is_refused(blob: bytes, origin: Origin, why: str) -> None:
    with pytest.raises(TransferRefused, match=why):
        unpack(blob, origin, max_tokens=8)
