"""The states a model slot goes through, and the one table of the moves allowed between them.

Owns: `State`, `MOVES` (from each state, the states it may go to; any other move raises
`IllegalMove`), and `Lifecycle`, a slot's current state with a bounded wait for a state (`reached`),
so a test awaits a swap's end instead of sleeping.
Must not: know what a state holds (a runtime, a standby) or do any of the work (swapper.py does).
"""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Mapping
from types import MappingProxyType


class State(enum.Enum):
    EMPTY = "empty"  # no model: a slot past 0 none was loaded into, or one emptied
    LOADING = "loading"  # a model is being built into it (the first, into a free slot, or from standby)
    SERVING = "serving"
    SWAPPING = "swapping"  # its model drains, is closed, and another loaded in its place
    UNLOADING = "unloading"  # its model drains and is closed (idle past its keep-alive, or making room)
    DRAINING = "draining"  # its model's file is gone and no other offered: it drains, then the worker stops
    STANDBY = "standby"  # its model unloaded, the last one: the closed runtime beats on, holding nothing


# A failed load leaves the slot as it was before it (EMPTY, STANDBY); a failed swap or unload leaves it
# with what it holds then (swapper.py's `_settle`): SERVING, STANDBY or EMPTY.
MOVES: Mapping[State, frozenset[State]] = MappingProxyType({
    State.EMPTY: frozenset({State.LOADING}),
    State.LOADING: frozenset({State.SERVING, State.EMPTY, State.STANDBY}),
    State.SERVING: frozenset({State.SWAPPING, State.UNLOADING, State.DRAINING}),
    State.SWAPPING: frozenset({State.SERVING, State.EMPTY}),
    State.UNLOADING: frozenset({State.STANDBY, State.EMPTY, State.SERVING}),
    State.DRAINING: frozenset({State.EMPTY}),
    State.STANDBY: frozenset({State.LOADING, State.EMPTY}),
})
BUSY = frozenset({State.LOADING, State.SWAPPING, State.UNLOADING, State.DRAINING})  # work runs in it


class IllegalMove(RuntimeError):
    """A move `MOVES` does not allow: a bug in whoever asked for it, never a client's refusal."""


class Lifecycle:
    """One slot's state. `to` moves it (or raises `IllegalMove`) and wakes whoever awaits the new state."""

    def __init__(self, state: State = State.EMPTY) -> None:
        self._state = state
        self._waiting: list[tuple[State, asyncio.Future[None]]] = []

    @property
    def state(self) -> State:
        return self._state

    def to(self, state: State) -> None:
        if state not in MOVES[self._state]:
            raise IllegalMove(f"a slot cannot go from {self._state.value} to {state.value}")
        self._state = state
        still = []
        for wanted, future in self._waiting:
            if wanted is state and not future.done():
                future.set_result(None)
            elif not future.done():
                still.append((wanted, future))
        self._waiting = still

    async def reached(self, state: State, timeout: float) -> None:
        """Returns once the slot is in `state` (at once if it is); `TimeoutError` after `timeout` seconds."""
        if self._state is state:
            return
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiting.append((state, future))
        try:
            await asyncio.wait_for(asyncio.shield(future), timeout)
        finally:
            if not future.done():
                future.cancel()
