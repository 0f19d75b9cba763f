"""An approximate index of which worker was sent which prompt prefix, for prefix-aware routing.

Owns: chained hashes of a prompt's text in fixed-size blocks (block i's hash covers blocks 0..i, so
equal hashes mean equal prefixes), a bounded LRU from block hash to the workers recently sent that
prefix, and `match`: for each worker, the share of a new prompt's blocks it was sent before.
Must not: pretend to know a worker's KV cache. It has no tokenizer and sees no evictions: it knows
what was sent where, which is what llm-d's approximate prefix scorer and SGLang's cache-aware router
go by too. A worker that dropped a prefix only costs the scorer a wrong guess; the worker's own
prompt cache decides what is really reused.

The text of a request is its prompt, or its tools and messages as `tools\\0role\\0content\\0...`, so
conversations and shared system prompts share prefixes the same way the workers' rendered prompts do.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence

from protocol.worker import GenerateRequest


def request_text(request: GenerateRequest) -> str:
    if request.prompt is not None:
        return request.prompt
    tools = request.tools.model_dump_json() + "\0" if request.tools is not None else ""
    return tools + "".join(f"{m.role}\0{m.said()}\0" for m in request.messages or ())


def block_hashes(model: str | None, text: str, block_chars: int, limit: int, *, tenant: str = "") -> list[bytes]:
    """Chained hashes of the whole blocks of `text` (a partial last block is not indexed), at most `limit`.
    Per tenant: the workers reuse a prompt's cells only for the tenant that sent it, so another tenant's
    identical prefix is another prefix."""
    seed = (model or "") if not tenant else f"{tenant}\0{model or ''}"
    digest = hashlib.blake2b(seed.encode(), digest_size=16)
    out = []
    for start in range(0, min(len(text), block_chars * limit) - block_chars + 1, block_chars):
        digest.update(text[start:start + block_chars].encode())
        out.append(digest.copy().digest())
    return out


class PrefixIndex:
    def __init__(self, *, block_chars: int, capacity: int, max_blocks: int = 1024) -> None:
        self.block_chars = block_chars
        self.capacity = capacity  # block hashes remembered, all workers together
        self.max_blocks = max_blocks  # blocks indexed per request: bounds the work per request
        self._workers: OrderedDict[bytes, set[str]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._workers)

    def hashes(self, model: str | None, request: GenerateRequest) -> list[bytes]:
        if self.capacity <= 0:
            return []
        return block_hashes(model, request_text(request), self.block_chars, self.max_blocks, tenant=request.tenant)

    def match(self, hashes: Sequence[bytes]) -> dict[str, float]:
        """worker id -> the share of these blocks (from the first on, unbroken) it was sent before."""
        if not hashes:
            return {}
        depth: dict[str, int] = {}
        for i, h in enumerate(hashes):
            holders = self._workers.get(h)
            if not holders:
                break
            for worker in holders:  # a chained hash: holding block i means it was sent blocks 0..i
                depth[worker] = i + 1
        return {worker: n / len(hashes) for worker, n in depth.items()}

    def record(self, hashes: Sequence[bytes], worker_id: str) -> None:
        for h in hashes:
            holders = self._workers.get(h)
            if holders is None:
                self._workers[h] = {worker_id}
            else:
                holders.add(worker_id)
                self._workers.move_to_end(h)
        while len(self._workers) > self.capacity:
            self._workers.popitem(last=False)

    def forget_worker(self, worker_id: str) -> None:
        """A worker left the pool: its cache is gone. O(index), on removal only."""
        for h in list(self._workers):
            holders = self._workers[h]
            holders.discard(worker_id)
            if not holders:
                del self._workers[h]
