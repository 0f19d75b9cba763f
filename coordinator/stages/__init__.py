"""The stages a request passes through around the gateway's steps: each concern that spans a request
(its span, its priority class, its key's limits, its fair-share charge) in a module of its own.

Owns: the contract between a stage and the gateway, and `Stages`, which enters a request into each
stage in the order listed and has it leave them, in the reverse order, exactly once: `failed` when it
never opened (refused, or raised before its first byte), `ended` when it ran and its answer ended.
A stage that refuses raises a `CoordinatorError`; the stages entered before it leave at once. One
stage that raises on the way out does not keep the others from leaving (the first error is raised
after all have run).
Must not: know the steps themselves (the gateway orders them) or any public wire format.

A new cross-cutting concern is one module here with its test, and one line in the gateway's lists.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar

from coordinator.auth import Client
from coordinator.embedding import Embedding
from coordinator.generation import Generation

W = TypeVar("W", Generation, Embedding)  # the kinds of request that pass stages


@dataclass(slots=True)
class Entry(Generic[W]):
    """One request on its way in. A stage may put a changed request in `work` (the span begun, the class
    set) and set what the steps after it read: `rank` (its class in the queue's order) and `on_token`
    (called for each token event relayed)."""

    work: W
    client: Client | None  # the API key that let it in; None: no key is needed
    headers: Mapping[str, str]
    rank: int = 0
    on_token: Callable[[], None] | None = None


@dataclass(frozen=True, slots=True)
class End:
    """How a request that ran ended, as its stages need to know it."""

    worker_id: str
    model: str
    prompt_tokens: int = 0  # as its usage says (0 for a cached answer)
    generated_tokens: int = 0  # as its usage says, or the tokens relayed when it ended without one
    relayed: int = 0  # tokens relayed to the client (each charged as it went)
    failure: str | None = None  # why it ended short of its answer; None: it ended whole
    attributes: Mapping[str, str | int] = field(default_factory=dict)  # more for its span


class Leave(Protocol):
    """What a stage does when a request it let in leaves: exactly one of the two is called, once."""

    def failed(self, exc: BaseException) -> None: ...

    def ended(self, end: End) -> None: ...


class Leaving:
    """A `Leave` made of two callables, for a stage whose way out is a call or two."""

    __slots__ = ("ended", "failed")

    def __init__(self, failed: Callable[[BaseException], None], ended: Callable[[End], None]) -> None:
        self.failed, self.ended = failed, ended


class Stage(Protocol[W]):
    def enter(self, entry: Entry[W]) -> Leave | None:
        """Let the request in (maybe changing `entry`), or raise a `CoordinatorError` to refuse it.
        Returns what to do when it leaves; None: nothing."""
        ...


class Passage(Generic[W]):
    """A request inside its stages: it leaves them once, in the reverse order of entering."""

    __slots__ = ("_leaves", "entry")

    def __init__(self, entry: Entry[W], leaves: list[Leave]) -> None:
        self.entry: Entry[W] = entry
        self._leaves = leaves

    @property
    def work(self) -> W:
        return self.entry.work

    def failed(self, exc: BaseException) -> None:
        _each(self._take(), lambda leave: leave.failed(exc))

    def ended(self, end: End) -> None:
        _each(self._take(), lambda leave: leave.ended(end))

    def _take(self) -> list[Leave]:
        leaves, self._leaves = self._leaves, []  # a second call does nothing
        return leaves[::-1]


class Stages(Generic[W]):
    """The stages of one kind of request, in the order a request enters them."""

    def __init__(self, stages: Sequence[Stage[W]]) -> None:
        self._stages: tuple[Stage[W], ...] = tuple(stages)

    def enter(self, work: W, client: Client | None, headers: Mapping[str, str] | None) -> Passage[W]:
        entry: Entry[W] = Entry(work, client, headers or {})
        leaves: list[Leave] = []
        try:
            for stage in self._stages:
                leave = stage.enter(entry)
                if leave is not None:
                    leaves.append(leave)
        except BaseException as exc:
            Passage(entry, leaves).failed(exc)
            raise
        return Passage(entry, leaves)


def _each(leaves: Iterable[Leave], call: Callable[[Leave], None]) -> None:
    first: BaseException | None = None
    for leave in leaves:
        try:
            call(leave)
        except BaseException as exc:  # noqa: BLE001  (the others still leave; the first is raised below)
            first = first or exc
    if first is not None:
        raise first
