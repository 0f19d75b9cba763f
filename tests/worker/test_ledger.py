"""The tenants' ledger: what each tenant was served here, for the heartbeats; and the engine's
observers fanned out to it and the metrics."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from worker.engine.jobs import EngineObserver, Failed, Finished, Observers
from worker.ledger import TenantLedger


def finished(prompt: int, generated: int) -> Finished:
    return Finished(reason="stop", prompt_tokens=prompt, cached_tokens=0, completion_tokens=generated, queue_s=0.0,
                    prefill_s=0.0, ttft_s=0.0, total_s=0.0)


def job(tenant: str) -> Any:
    return SimpleNamespace(request=SimpleNamespace(tenant=tenant))


def test_each_ended_request_counts_for_its_tenant_and_a_failed_one_not() -> None:
    ledger = TenantLedger()
    ledger.finished(job("t:a"), finished(10, 5))
    ledger.finished(job("t:a"), finished(3, 2))
    ledger.finished(job("t:b"), finished(7, 0))
    ledger.finished(job("t:b"), Failed(reason="engine_failed", message="x"))
    assert ledger.totals() == {"t:a": (13, 7), "t:b": (7, 0)}


def test_the_ledger_forgets_the_least_recently_served_past_its_bound() -> None:
    ledger = TenantLedger(max_tenants=2)
    for tenant in ("t:a", "t:b", "t:a", "t:c"):
        ledger.served(tenant, 1, 1)
    assert set(ledger.totals()) == {"t:a", "t:c"}


def test_observers_reach_each_of_theirs_in_order() -> None:
    seen: list[tuple[str, str]] = []

    class Recording(EngineObserver):
        def __init__(self, name: str) -> None:
            self.name = name

        def finished(self, job: Any, item: Any) -> None:
            seen.append((self.name, "finished"))

        def step(self, sequences: int, prefill_tokens: int, seconds: float, decoding: int = 0) -> None:
            seen.append((self.name, "step"))

    both = Observers(Recording("metrics"), Recording("ledger"))
    both.step(1, 0, 0.0)
    both.finished(job("t:a"), finished(1, 1))
    both.token_gap(0.1)
    both.internal_error("x")
    assert seen == [("metrics", "step"), ("ledger", "step"), ("metrics", "finished"), ("ledger", "finished")]
