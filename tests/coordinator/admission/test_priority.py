"""Priority classes on their own: what a request asks for, what its key allows, and the queue putting
a higher class first whatever the counters say."""

from __future__ import annotations

import pytest

from coordinator.admission import priority
from coordinator.admission.fairness import FairShares
from coordinator.admission.queue import AdmissionQueue
from coordinator.auth import ApiKeys, KeyLimits
from coordinator.errors import CoordinatorError

BATCH, INTERACTIVE = priority.rank("batch"), priority.rank("interactive")


@pytest.mark.parametrize(("header", "body", "expected"), [
    (None, None, ""), ("batch", None, "batch"), (None, "interactive", "interactive"),
    (" Batch ", "batch", "batch"), ("", None, ""),
])
def test_a_request_names_its_class_in_a_header_or_its_body(header: str | None, body: str | None,
                                                            expected: str) -> None:
    assert priority.asked(header, body) == expected


@pytest.mark.parametrize(("header", "body", "message"), [
    ("urgent", None, "'urgent' is not a priority class"),
    ("batch", "interactive", "the x-priority header says 'batch' and the body 'interactive'"),
])
def test_an_unknown_class_or_two_that_disagree_are_400(header: str, body: str | None, message: str) -> None:
    with pytest.raises(CoordinatorError, match=message) as refused:
        priority.asked(header, body)
    assert (refused.value.status, refused.value.param) == (400, "priority")


def test_a_class_above_the_keys_highest_is_400_and_none_named_is_the_keys_default() -> None:
    assert priority.resolve("", "batch", "interactive") == BATCH
    assert priority.resolve("interactive", "batch", "interactive") == INTERACTIVE
    with pytest.raises(CoordinatorError, match="'interactive' is above this key's highest class 'batch'") as above:
        priority.resolve("interactive", "batch", "batch")
    assert above.value.status == 400


def test_a_keys_classes_come_from_its_entry_and_a_default_above_its_highest_is_refused() -> None:
    keys = ApiKeys(["nightly-key jobs 1 priority=batch max_priority=batch rpm=10", "app-key app"])
    nightly = keys.identify({"x-api-key": "nightly-key"})
    assert nightly is not None and nightly.limits == KeyLimits(rpm=10, priority="batch", max_priority="batch")
    with pytest.raises(ValueError, match="entry 1: priority=interactive is above max_priority=batch"):
        ApiKeys(["k max_priority=batch"])
    with pytest.raises(ValueError, match="entry 1: priority='urgent' is not a priority class"):
        ApiKeys(["k priority=urgent"])


pytestmark = pytest.mark.anyio


async def test_a_waiting_interactive_request_goes_before_batch_ones_whatever_the_counters() -> None:
    fair = FairShares()
    queue = AdmissionQueue(size=8, timeout=5, retry_after=1, fair=fair)
    for tenant in ("jobs", "app"):
        fair.arrive(tenant)
    fair.charge_output("app", 1000)  # app has been served far more: within a class it would go last
    batch = [queue.join("m", "jobs", BATCH) for _ in range(2)]
    urgent = queue.join("m", "app", INTERACTIVE)
    assert queue.is_head(urgent)
    queue.wake("m")
    assert urgent.future.done() and not any(w.future.done() for w in batch)
    queue.leave(urgent)
    assert queue.is_head(batch[0]) and batch[0].future.done()  # batch takes what no interactive waits for


async def test_without_keys_classes_still_order_the_queue() -> None:
    queue = AdmissionQueue(size=8, timeout=5, retry_after=1, fair=None)
    first = queue.join("m", "", BATCH)
    urgent = queue.join("m", "", INTERACTIVE)
    assert queue.is_head(urgent) and not queue.is_head(first)
