"""KV room: the worker's free KV bytes cover the request's reservation (`Demand.tokens`, capped by
the worker's session limit, times its bytes per token); KV held by idle kept sessions counts as free,
since the worker evicts them to admit a request. For an interactive request, a worker with a batch
request it can park passes: parking returns that request's KV, and the worker checks what it needs."""

from __future__ import annotations

from dataclasses import dataclass

from coordinator.scheduling.plugin import Plugin
from coordinator.scheduling.view import Request, WorkerView
from protocol import reasons


@dataclass(frozen=True)
class KvRoom:
    reason: str = reasons.KV_FULL

    def keep(self, request: Request, worker: WorkerView, now: float) -> bool:
        need = request.demand.tokens(worker.session_max_tokens) * worker.bytes_per_token
        return (worker.kv_capacity_bytes - worker.kv_reserved_bytes + worker.idle_kv_bytes >= need
                or (request.demand.preempts and worker.preemptible > 0))


PLUGIN = Plugin("kv_room", lambda options: KvRoom(), order=60)
