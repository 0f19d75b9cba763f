"""The order prompts are prefilled in (worker/engine/line.py): the tenant with the fewest sequences
decoding here for its weight first, then the shortest remaining prompt, then the oldest."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from worker.engine.line import prefill_order

pytestmark = pytest.mark.unit


@dataclass(frozen=True)
class Request:
    tenant: str = ""
    tenant_weight: float = 1.0


@dataclass(frozen=True)
class Job:
    request: Request


@dataclass(eq=False)
class Seq:
    name: str
    todo: list[int] = field(default_factory=list)
    started_at: float = 0.0
    tenant: str = ""
    weight: float = 1.0

    @property
    def job(self) -> Job:
        return Job(Request(self.tenant, self.weight))


def decoding(tenant: str, count: int, weight: float = 1.0) -> list[Seq]:
    return [Seq(f"{tenant}-running-{i}", tenant=tenant, weight=weight) for i in range(count)]


def names(seqs: list[Seq]) -> list[str]:
    return [s.name for s in prefill_order(seqs)]


def test_one_tenant_goes_shortest_then_oldest_as_before() -> None:
    seqs = [Seq("long", [0] * 50, 1.0), Seq("short-late", [0] * 5, 3.0), Seq("short-early", [0] * 5, 2.0),
            *decoding("", 4)]
    assert names(seqs) == ["short-early", "short-late", "long"]


def test_the_tenant_with_fewer_sequences_decoding_goes_first_whatever_its_length_or_age() -> None:
    seqs = [*decoding("heavy", 12), *decoding("light", 1),
            *(Seq(f"heavy-{i}", [0] * 20, float(i), tenant="heavy") for i in range(5)),
            Seq("light", [0] * 30, 9.0, tenant="light")]
    assert names(seqs)[0] == "light"
    assert names(seqs)[1:] == [f"heavy-{i}" for i in range(5)]  # then shortest, then oldest, as before


def test_a_weight_divides_what_a_tenant_holds() -> None:
    # Weighted 8, the big tenant's 12 sequences count as 1.5: below the other's 2.
    seqs = [*decoding("big", 12, weight=8.0), *decoding("small", 2),
            Seq("small-next", [0] * 5, 0.0, tenant="small"), Seq("big-next", [0] * 20, 1.0, tenant="big", weight=8.0)]
    assert names(seqs) == ["big-next", "small-next"]
