"""least-latency: the lowest recent time to first token first.

Each worker's TTFT is an exponentially weighted average of its streams' samples (the coordinator
records them). While a worker gets no traffic its average decays towards zero with a half-life of
`half_life` seconds, so one slow sample does not keep it out for ever: it is tried again, and its
next sample tells. A worker with no sample yet ranks first (it has to be measured once)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from coordinator.scheduling.view import Request, WorkerView


@dataclass(frozen=True)
class LeastLatency:
    half_life: float = 10.0
    name: str = "least-latency"

    def latency(self, worker: WorkerView, now: float) -> float:
        if worker.ttft_ewma is None:
            return 0.0
        idle = max(0.0, now - worker.ttft_at)
        return worker.ttft_ewma * 0.5 ** (idle / self.half_life)

    def rank(self, request: Request, workers: Sequence[WorkerView], scores: Mapping[str, float],
             now: float) -> list[WorkerView]:
        return sorted(workers, key=lambda w: (self.latency(w, now), w.worker_id))
