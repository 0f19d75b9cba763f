"""least-latency: the lowest expected time to first token first.

Each worker's TTFT is an exponentially weighted average of its streams' samples (the coordinator
records them when a stream ends). Weighed by the streams already in flight on the worker plus one (the
cost model of linkerd's peak-EWMA balancer), so a burst spreads instead of piling onto whichever worker
was fastest a moment ago: its samples only arrive as its streams end. While a worker has nothing in
flight its average decays towards zero with a half-life of `half_life` seconds, so one slow sample
does not keep it out for ever. A worker with no sample yet counts as zero (it has to be measured once).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from coordinator.scheduling.plugin import Plugin
from coordinator.scheduling.view import Request, WorkerView


@dataclass(frozen=True)
class LeastLatency:
    half_life: float = 10.0
    name: str = "least-latency"

    def latency(self, worker: WorkerView, now: float) -> float:
        if worker.ttft_ewma is None:
            return 0.0
        if worker.in_flight:
            return worker.ttft_ewma
        return worker.ttft_ewma * 0.5 ** (max(0.0, now - worker.ttft_at) / self.half_life)

    def rank(self, request: Request, workers: Sequence[WorkerView], scores: Mapping[str, float],
             now: float) -> list[WorkerView]:
        return sorted(workers, key=lambda w: (self.latency(w, now) * (1 + w.in_flight), w.in_flight, w.worker_id))


PLUGIN = Plugin("least-latency", lambda options: LeastLatency(options.latency_half_life))
