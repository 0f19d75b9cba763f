"""When batch rows may join a step beside interactive ones: interactive steps average at most `slowdown`
times their time alone; with no interactive sequence the batch rows join every step."""

import math

import pytest

from worker.engine.batch_share import BatchShare

ALONE, WITH = 0.020, 0.075  # seconds: a CPU step of one interactive row, and with six batch rows beside it


def run(share: BatchShare, steps: int) -> tuple[float, int]:
    """`steps` interactive steps, each with the batch rows when the share admits them: their mean time,
    and how many carried batch rows."""
    total, batch = 0.0, 0
    for _ in range(steps):
        joins = share.admits(interactive=True)
        seconds = WITH if joins else ALONE
        share.observe(seconds, interactive=True, batch=joins)
        total, batch = total + seconds, batch + joins
    return total / steps, batch


@pytest.mark.parametrize("slowdown", [1.2, 1.5, 2.0])
def test_interactive_steps_average_at_most_slowdown_times_alone_and_the_batch_still_goes_on(slowdown: float) -> None:
    share = BatchShare(slowdown)
    run(share, 20)  # both step times measured
    mean, batch = run(share, 600)
    assert mean <= slowdown * ALONE * 1.01
    # What the share allows, earned by whole interactive-only steps: one batch step after each run of them.
    earning = math.ceil((WITH - ALONE) / ((slowdown - 1) * ALONE) - 1e-9)
    assert batch >= 600 // (earning + 1) - 2


def test_without_interactive_rows_the_batch_joins_every_step_and_no_credit_is_banked() -> None:
    share = BatchShare(1.2)
    run(share, 50)
    for _ in range(100):
        assert share.admits(interactive=False)
        share.observe(WITH, interactive=False, batch=True)
    assert share.credit == 0.0
    mean, _ = run(share, 30)  # the interactive stream that comes back is owed from its start
    assert mean <= 1.2 * ALONE * 1.1


def test_one_never_beside_interactive_rows_once_measured_and_zero_every_step() -> None:
    never = BatchShare(1.0)
    run(never, 5)
    assert run(never, 200)[1] == 0
    off = BatchShare(0.0)
    assert run(off, 200)[1] == 200


def test_a_step_with_prompt_tokens_is_no_measure_and_neither_earns_nor_costs() -> None:
    share = BatchShare(1.2)
    share.observe(0.5, interactive=True, batch=False, prompt=40)  # a prefill: long, and not decoding
    assert share.alone_s is None and not share.admits(interactive=True)
    run(share, 40)
    credit, alone = share.credit, share.alone_s
    share.observe(0.5, interactive=True, batch=True, prompt=40)
    assert (share.credit, share.alone_s) == (credit, alone)
