"""What this worker has served each tenant: prompt and generated tokens of the requests that ended
here, since it started, for its heartbeats (`protocol.health.TenantUse`).

Owns: the per-tenant counters, bounded (the least recently served tenant is forgotten past
`MAX_TENANTS`), safe to update from the engine thread while the heartbeat reads them.
Must not: judge fairness (every coordinator does, from what all the workers report).

Every coordinator of a pool adds what the others' requests were served here to its own fair-share
counters, so N coordinators order tenants by the pool's service, not each by its own share of it.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

from worker.engine.jobs import EngineObserver, Failed, Finished, Job

MAX_TENANTS = 1024


class TenantLedger(EngineObserver):
    """An engine observer: `finished` counts each ended request's tokens for its tenant."""

    def __init__(self, max_tenants: int = MAX_TENANTS) -> None:
        self._lock = threading.Lock()
        self._served: OrderedDict[str, tuple[int, int]] = OrderedDict()  # tenant -> (prompt, generated)
        self._max = max_tenants

    def finished(self, job: Job, item: Finished | Failed) -> None:
        if isinstance(item, Finished):
            self.served(job.request.tenant, item.prompt_tokens, item.completion_tokens)

    def served(self, tenant: str, prompt_tokens: int, generated_tokens: int) -> None:
        with self._lock:
            prompt, generated = self._served.pop(tenant, (0, 0))
            self._served[tenant] = (prompt + prompt_tokens, generated + generated_tokens)
            if len(self._served) > self._max:
                self._served.popitem(last=False)

    def totals(self) -> dict[str, tuple[int, int]]:
        with self._lock:
            return dict(self._served)
