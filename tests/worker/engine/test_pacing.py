"""The prefill pace: beside decoding sequences a step carries a prompt chunk only when they are owed
no time, so that over a chunk step and the decode-only steps that pay for it they run at least
1/stall as fast as alone, counted from a joining sequence's arrival; with nothing decoding every step
may carry one."""

from __future__ import annotations

import random

import pytest

from worker.engine.pacing import PrefillPace


def test_nothing_decoding_always_admits_and_off_admits_always() -> None:
    pace = PrefillPace(stall=2.0)
    assert pace.admits(decoding=0)
    for stall in (1.0, 0.0):
        off = PrefillPace(stall=stall)
        off.observe(decoding=3, prompt=0, seconds=0.1)
        off.observe(decoding=3, prompt=64, seconds=1.0)
        assert off.admits(decoding=3)


def test_beside_decoding_a_decode_only_step_comes_first_as_the_measure() -> None:
    pace = PrefillPace(stall=2.0)
    assert not pace.admits(decoding=1)
    pace.observe(decoding=1, prompt=0, seconds=0.03)
    assert pace.admits(decoding=1)


@pytest.mark.parametrize(("decode_s", "chunk_s", "stall"), [
    (0.030, 0.380, 2.0),   # CPU, one thread: a 64-token chunk is 12 decode steps
    (0.089, 0.380, 2.0),   # four rows decoding
    (0.089, 0.380, 1.5),
    (0.320, 0.380, 2.0),   # sixteen rows: the chunk nearly free beside them
    (0.010, 0.012, 2.0),   # a GPU
])
def test_over_many_steps_the_decoding_sequences_run_at_least_one_stall_th_as_fast_as_alone(
        decode_s: float, chunk_s: float, stall: float) -> None:
    """A long prompt's chunks beside decoding rows: the steps' time per decoded token stays within
    `stall` x a decode-only step's, and the prompt still gets most of what is left."""
    pace = PrefillPace(stall=stall)
    rng = random.Random(7)
    elapsed = chunk_time = 0.0
    steps = 2000
    for _ in range(steps):
        chunk = pace.admits(decoding=2)
        seconds = (chunk_s if chunk else decode_s) * rng.uniform(0.9, 1.1)  # a noisy machine
        pace.observe(decoding=2, prompt=64 if chunk else 0, seconds=seconds)
        elapsed += seconds
        chunk_time += seconds if chunk else 0.0
    slowdown = elapsed / (steps * decode_s)
    assert slowdown <= stall * 1.05, slowdown
    # What the stall allows goes to the prompt: its share of the time is near (stall - 1) / stall
    # of the time beyond the decode steps', or every step when chunks are that cheap.
    assert chunk_time / elapsed >= min(0.95, (1 - 1 / stall) * 0.8), chunk_time / elapsed


def test_credit_from_a_long_run_of_decode_only_steps_is_capped_at_one_chunk_step() -> None:
    pace = PrefillPace(stall=2.0)
    pace.observe(decoding=2, prompt=0, seconds=0.03)
    pace.observe(decoding=2, prompt=64, seconds=0.38)
    for _ in range(1000):  # a long quiet stretch: the prompt was elsewhere
        pace.observe(decoding=2, prompt=0, seconds=0.03)
    chunks = 0
    while pace.admits(decoding=2):
        pace.observe(decoding=2, prompt=64, seconds=0.38)
        chunks += 1
    assert chunks == 1  # then the decoding sequences are owed their time again


def decode_steps_until_a_chunk(pace: PrefillPace, *, decoding: int, seconds: float = 0.03) -> int:
    """Decode-only steps of `seconds` each, observed until the pace admits a chunk beside `decoding` rows."""
    steps = 0
    while not pace.admits(decoding=decoding):
        pace.observe(decoding=decoding, prompt=0, seconds=seconds)
        steps += 1
        assert steps < 10_000, "the pace never admits a chunk"
    return steps


def test_a_chunk_beside_decoding_is_paid_for_before_it_goes_in() -> None:
    """A new stream's first steps: no chunk until the decode-only steps have earned what it costs
    them (0.38 s less 2 x 0.03 s, at 0.03 s a step: 11 steps), so a 16-token chat gets at most one."""
    pace = PrefillPace(stall=2.0)
    pace.observe(decoding=0, prompt=64, seconds=0.38)  # a long prompt alone
    pace.observe(decoding=1, prompt=0, seconds=0.03)
    assert pace.admits(decoding=0)
    assert 1 + decode_steps_until_a_chunk(pace, decoding=1) == 11


def test_a_step_with_nothing_decoding_clears_debt_and_credit() -> None:
    pace = PrefillPace(stall=2.0)
    pace.observe(decoding=2, prompt=0, seconds=0.03)
    pace.observe(decoding=2, prompt=64, seconds=0.38)
    assert pace.debt > 0 and not pace.admits(decoding=2)
    pace.observe(decoding=0, prompt=64, seconds=0.38)
    assert pace.debt == 0 and pace.admits(decoding=0) and not pace.admits(decoding=1)


def test_sequences_that_join_are_owed_the_step_they_may_have_waited_out() -> None:
    """Four chats come while a long prompt's chunk step runs alone (0.38 s): their prompts' step owes
    them that step, so the next chunk waits until the decode-only steps have paid it and the chunk's
    own cost (0.38 + 0.38 - 2 x 0.03 s at 0.03 s a step: 24 steps): none within a 16-token chat."""
    pace = PrefillPace(stall=2.0)
    pace.observe(decoding=0, prompt=64, seconds=0.38)  # the long prompt alone; the chats arrive
    pace.observe(decoding=0, prompt=24, seconds=0.05, joining=4)  # their prompts, nothing else
    assert pace.debt == pytest.approx(0.38)
    assert decode_steps_until_a_chunk(pace, decoding=4) == 24


def test_a_sequence_joining_beside_decoding_ones_is_owed_its_wait_too() -> None:
    """The debt is at least the step before a join (the chunk step the newcomer waited out), and no
    less than what the sequences already decoding were owed."""
    pace = PrefillPace(stall=2.0)
    pace.observe(decoding=2, prompt=0, seconds=0.03)
    pace.observe(decoding=2, prompt=64, seconds=0.38)  # paid for: the debt is now at most 0
    pace.observe(decoding=2, prompt=5, seconds=0.04, joining=1)  # a chat that came during it joins
    assert pace.debt == pytest.approx(0.38)
    pace.observe(decoding=3, prompt=0, seconds=0.03)
    pace.observe(decoding=3, prompt=64, seconds=0.9)  # a debt larger than the step before
    owed = pace.debt
    pace.observe(decoding=3, prompt=3, seconds=0.04, joining=1)
    assert pace.debt == pytest.approx(owed + 0.04 - 2 * pace.decode_s)  # kept, as the larger


def test_what_a_join_is_owed_is_cleared_once_nothing_decodes() -> None:
    """A join with nothing decoding before it still owes the step before; once the joined sequence
    has ended (no decoding rows), the next step clears it."""
    pace = PrefillPace(stall=2.0)
    pace.observe(decoding=0, prompt=64, seconds=0.38)
    pace.observe(decoding=0, prompt=64, seconds=0.38, joining=1)
    assert pace.debt == pytest.approx(0.38)
    pace.observe(decoding=0, prompt=64, seconds=0.38)
    assert pace.debt == 0 and pace.admits(decoding=0)
