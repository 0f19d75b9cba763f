"""coordinator/stages: a request enters its stages in order and leaves them once, in reverse order, by
exactly one way; a refusal leaves those entered; one stage failing on the way out keeps no other in."""

from __future__ import annotations

import pytest

from coordinator.admission.fairness import FairShares
from coordinator.admission.limits import Limits
from coordinator.auth import Client, KeyLimits
from coordinator.clock import ManualClock
from coordinator.errors import CoordinatorError
from coordinator.generation import Generation
from coordinator.stages import End, Entry, Stages
from coordinator.stages.fair_charge import FairCharge
from coordinator.stages.key_limits import KeyLimitStage
from coordinator.stages.priority_class import PriorityClass
from coordinator.stages.span import Span
from protocol import reasons
from protocol.worker import GenerateRequest
from serving.tracing import NO_TRACE, Tracing

pytestmark = pytest.mark.unit
END = End("w1", "smol", prompt_tokens=5, generated_tokens=7, relayed=4)


def generation(priority: str = "", tenant: str = "acme") -> Generation:
    return Generation.of(GenerateRequest(prompt="hi", max_tokens=8, tenant=tenant), "r1", "infer", priority)


class Noting:
    """A stage that notes what happens to it in `log`; `refuse`: it refuses every request."""

    def __init__(self, name: str, log: list[str], *, refuse: bool = False, fail_leaving: bool = False) -> None:
        self.name, self.log, self.refuse, self.fail_leaving = name, log, refuse, fail_leaving

    def enter(self, entry: Entry[Generation]) -> Noting:
        if self.refuse:
            raise CoordinatorError(reasons.RATE_LIMITED, "no")
        self.log.append(f"enter {self.name}")
        return self

    def failed(self, exc: BaseException) -> None:
        self.log.append(f"failed {self.name}")
        if self.fail_leaving:
            raise RuntimeError(self.name)

    def ended(self, end: End) -> None:
        self.log.append(f"ended {self.name}")
        if self.fail_leaving:
            raise RuntimeError(self.name)


def test_a_request_leaves_its_stages_in_reverse_order_once() -> None:
    log: list[str] = []
    passage = Stages([Noting("a", log), Noting("b", log)]).enter(generation(), None, None)
    passage.ended(END)
    passage.ended(END)  # a second end does nothing
    passage.failed(RuntimeError())  # nor does the other way out, once it left
    assert log == ["enter a", "enter b", "ended b", "ended a"]


def test_a_refusal_leaves_the_stages_entered_before_it_and_no_other() -> None:
    log: list[str] = []
    stages = Stages([Noting("a", log), Noting("b", log, refuse=True), Noting("c", log)])
    with pytest.raises(CoordinatorError):
        stages.enter(generation(), None, None)
    assert log == ["enter a", "failed a"]


def test_a_stage_that_raises_on_its_way_out_keeps_no_other_in() -> None:
    log: list[str] = []
    passage = Stages([Noting("a", log), Noting("b", log, fail_leaving=True)]).enter(generation(), None, None)
    with pytest.raises(RuntimeError, match="b"):
        passage.failed(ValueError())
    assert log == ["enter a", "enter b", "failed b", "failed a"]


def test_the_span_carries_the_request_and_its_end() -> None:
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exported = InMemorySpanExporter()
    tracing = Tracing("svc", {}, exporter=exported)
    passage = Stages([Span(tracing), PriorityClass()]).enter(generation(), None, {})
    assert passage.work.trace is not NO_TRACE
    passage.ended(End("w1", "smol", failure="worker_failed", attributes={"llm_pool.tokens_relayed": 3}))
    refused = Stages([Span(tracing)]).enter(generation(), None, {})
    refused.failed(CoordinatorError(reasons.KV_FULL, "full"))
    tracing.shutdown()
    ended, failed = exported.get_finished_spans()
    assert ended.attributes is not None and failed.attributes is not None
    assert ended.attributes["llm_pool.worker"] == "w1" and ended.attributes["llm_pool.tokens_relayed"] == 3
    assert ended.attributes["llm_pool.priority"] == "interactive" and ended.attributes["llm_pool.tenant"] == "acme"
    assert not ended.status.is_ok and not failed.status.is_ok
    # Untraced: the request is not copied for a span.
    gen = generation()
    assert Stages([Span(None)]).enter(gen, None, {}).work is gen


def test_the_class_is_the_asked_one_or_the_keys_default_and_never_above_its_highest() -> None:
    nightly = Client("k", "jobs", KeyLimits(priority="batch", max_priority="batch"))
    stages = Stages([PriorityClass()])
    batch = stages.enter(generation(), nightly, None)
    assert (batch.entry.rank, batch.work.request.priority, batch.work.demand.preempts) == (0, "batch", False)
    interactive = stages.enter(generation(), None, None)
    assert (interactive.entry.rank, interactive.work.demand.preempts) == (1, True)
    with pytest.raises(CoordinatorError) as above:
        stages.enter(generation("interactive"), nightly, None)
    assert above.value.param == "priority"


def test_a_keys_request_counts_in_and_its_tokens_on_its_way_out() -> None:
    clock = ManualClock()
    limits = Limits(clock.time)
    one = Client("k", "acme", KeyLimits(streams=1, tpm=10))
    stages = Stages([KeyLimitStage(limits)])
    passage = stages.enter(generation(), one, None)
    with pytest.raises(CoordinatorError) as busy:
        stages.enter(generation(), one, None)  # its one stream is running
    assert busy.value.reason == reasons.RATE_LIMITED
    passage.ended(END)  # 12 tokens: past the 10 a minute
    with pytest.raises(CoordinatorError) as spent:
        stages.enter(generation(), one, None)
    assert "tokens a minute" in spent.value.message
    clock.advance(60)
    stages.enter(generation(), one, None).failed(RuntimeError())  # one that never opened used nothing
    stages.enter(generation(), one, None)
    assert stages.enter(generation(), None, None) is not None  # no key: no limits


def test_a_tenant_is_active_while_its_request_runs_and_is_charged_what_it_made() -> None:
    fair = FairShares(prompt_weight=1.0, output_weight=2.0, now=ManualClock().monotonic)
    stages = Stages([FairCharge(fair)])
    passage = stages.enter(generation(), None, None)
    assert fair.others_active("other") == 1
    assert passage.entry.on_token is not None
    for _ in range(4):
        passage.entry.on_token()  # each token event relayed
    assert fair.counter("acme") == 8.0
    passage.ended(END)  # its usage counts 7 generated: the 3 not relayed one by one are charged now
    assert fair.counter("acme") == 14.0 and fair.others_active("other") == 0
    stages.enter(generation(), None, None).failed(RuntimeError())
    assert fair.others_active("other") == 0


def test_with_fair_shares_on_the_worker_is_told_to_keep_headroom_and_given_the_tenants_weight() -> None:
    fair = FairShares(weights={"acme": 3.0}, now=ManualClock().monotonic)
    for headroom in (True, False):
        sent = Stages([FairCharge(fair, headroom=headroom)]).enter(generation(), None, None).work
        assert sent.request.fair_share is headroom and sent.request.tenant_weight == 3.0
        assert (b'"fair_share":true' in sent.payload) is headroom  # what the worker reads
    plain = Stages([FairCharge(FairShares(), headroom=False)]).enter(generation(), None, None).work
    assert plain.payload == generation().payload  # weight 1, no headroom: the request as it came
