"""worker/slots/states.py: the moves a slot may make are the table's, every other one raises; and a wait for a
state returns when the slot gets there, at once when it is there, and not past its timeout."""

from __future__ import annotations

import asyncio

import pytest

from worker.slots.states import BUSY, MOVES, IllegalMove, Lifecycle, State

pytestmark = pytest.mark.anyio
ALLOWED = {
    (State.EMPTY, State.LOADING),
    (State.LOADING, State.SERVING), (State.LOADING, State.EMPTY), (State.LOADING, State.STANDBY),
    (State.SERVING, State.SWAPPING), (State.SERVING, State.UNLOADING), (State.SERVING, State.DRAINING),
    (State.SWAPPING, State.SERVING), (State.SWAPPING, State.EMPTY),
    (State.UNLOADING, State.STANDBY), (State.UNLOADING, State.EMPTY), (State.UNLOADING, State.SERVING),
    (State.DRAINING, State.EMPTY),
    (State.STANDBY, State.LOADING), (State.STANDBY, State.EMPTY),
}


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.mark.parametrize("start", list(State))
@pytest.mark.parametrize("end", list(State))
def test_only_the_tables_moves_are_allowed(start: State, end: State) -> None:
    life = Lifecycle(start)
    if (start, end) in ALLOWED:
        life.to(end)
        assert life.state is end
    else:
        with pytest.raises(IllegalMove, match=f"from {start.value} to {end.value}"):
            life.to(end)
        assert life.state is start


def test_every_state_can_be_left_and_reached_and_the_busy_ones_end() -> None:
    assert set(MOVES) == set(State)
    assert {end for ends in MOVES.values() for end in ends} == set(State)
    assert all(MOVES[busy] - BUSY for busy in BUSY)  # a busy state always has a way out of being busy


async def test_a_wait_for_a_state_returns_once_the_slot_gets_there() -> None:
    life = Lifecycle(State.SERVING)
    await life.reached(State.SERVING, timeout=0.01)  # there already
    waiting = asyncio.create_task(life.reached(State.STANDBY, timeout=2.0))
    await asyncio.sleep(0)
    life.to(State.UNLOADING)
    await asyncio.sleep(0)
    assert not waiting.done()  # not the state it waits for
    life.to(State.STANDBY)
    await waiting


async def test_a_wait_for_a_state_never_reached_ends_at_its_timeout() -> None:
    life = Lifecycle(State.SERVING)
    with pytest.raises(TimeoutError):
        await life.reached(State.STANDBY, timeout=0.02)
    life.to(State.UNLOADING)  # the abandoned wait is dropped, not woken
    life.to(State.STANDBY)
