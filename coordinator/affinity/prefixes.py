"""An index of which worker holds which prompt prefix, for prefix-aware routing.

Owns: chained hashes of a prompt's text in fixed-size blocks (block i's hash covers blocks 0..i, so
equal hashes mean equal prefixes), a bounded LRU from block hash to the workers that hold that prefix,
and `match`: for each worker, the share of a new prompt's blocks it holds.
Two sources feed it. What this coordinator sent where (`record`), at once. And what each worker says
its cells hold (`report`, from every heartbeat): the request carries its blocks to the worker
(`GenerateRequest.prefix_blocks`), which lists them while its cells keep that prompt. So a prompt that
another coordinator sent is known here by the worker's next heartbeat, and a prefix the worker
evicted is dropped from the index then. It has no tokenizer: a block is text, and the worker's own
prompt cache decides what is really reused.
Every coordinator of a pool must hash alike (the same PREFIX_BLOCK_CHARS) for the reports to match.

The text of a request is its prompt, or its tools and messages as `tools\\0role\\0content\\0...`, so
conversations and shared system prompts share prefixes the same way the workers' rendered prompts do.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence

from protocol.worker import MAX_PREFIX_BLOCKS, GenerateRequest


def request_text(request: GenerateRequest) -> str:
    if request.prompt is not None:
        return request.prompt
    if request.prompt_tokens is not None:  # ids as text: a prefix of ids is a prefix of this text
        return "".join(f"{token}," for token in request.prompt_tokens)
    tools = request.tools.model_dump_json() + "\0" if request.tools is not None else ""
    return tools + "".join(f"{m.role}\0{m.said()}\0" for m in request.messages or ())


def block_hashes(model: str | None, text: str, block_chars: int, limit: int, *, tenant: str = "") -> list[bytes]:
    """Chained hashes of the whole blocks of `text` (a partial last block is not indexed), at most `limit`.
    Per tenant: the workers reuse a prompt's cells only for the tenant that sent it, so another tenant's
    identical prefix is another prefix."""
    seed = (model or "") if not tenant else f"{tenant}\0{model or ''}"
    digest = hashlib.blake2b(seed.encode(), digest_size=8)  # as PREFIX_BLOCK_PATTERN names it on the wire
    out = []
    for start in range(0, min(len(text), block_chars * limit) - block_chars + 1, block_chars):
        digest.update(text[start:start + block_chars].encode())
        out.append(digest.copy().digest())
    return out


class PrefixIndex:
    def __init__(self, *, block_chars: int, capacity: int, max_blocks: int = MAX_PREFIX_BLOCKS) -> None:
        self.block_chars = block_chars
        self.capacity = capacity  # block hashes remembered, all workers together
        self.max_blocks = max_blocks  # blocks indexed per request: bounds the work per request
        self._workers: OrderedDict[bytes, set[str]] = OrderedDict()
        self._reported: dict[str, frozenset[bytes]] = {}  # by worker: the blocks its last heartbeat listed

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
            self._add(h, worker_id, touch=True)
        self._bound()

    def report(self, worker_id: str, blocks: Sequence[str]) -> None:
        """A heartbeat of `worker_id` listing the prefix blocks its cells hold (hex, most recent first):
        those it no longer lists are no longer its; those it lists are (again, if the LRU dropped them).
        O(blocks listed) a heartbeat."""
        if self.capacity <= 0:
            return
        held = frozenset(bytes.fromhex(b) for b in blocks)
        for h in self._reported.get(worker_id, frozenset()) - held:
            self._discard(h, worker_id)
        for h in held:
            self._add(h, worker_id, touch=False)
        self._reported[worker_id] = held
        self._bound()

    def forget_worker(self, worker_id: str) -> None:
        """A worker left the pool: its cache is gone. O(index), on removal only."""
        self._reported.pop(worker_id, None)
        for h in list(self._workers):
            self._discard(h, worker_id)

    def _add(self, h: bytes, worker_id: str, *, touch: bool) -> None:
        """`worker_id` holds block `h`; `touch`: it was just sent there (the most recent in the LRU)."""
        holders = self._workers.get(h)
        if holders is None:
            self._workers[h] = {worker_id}
            return
        holders.add(worker_id)
        if touch:
            self._workers.move_to_end(h)

    def _discard(self, h: bytes, worker_id: str) -> None:
        holders = self._workers.get(h)
        if holders is not None:
            holders.discard(worker_id)
            if not holders:
                del self._workers[h]

    def _bound(self) -> None:
        while len(self._workers) > self.capacity:
            self._workers.popitem(last=False)
