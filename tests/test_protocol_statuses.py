"""Each reason has one HTTP status, in protocol/statuses.py, and both services answer with it."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from coordinator import errors as coordinator_errors
from coordinator.errors import CoordinatorError
from protocol import reasons
from protocol.statuses import RELAYED_STATUS_BY_REASON, STATUS_BY_REASON
from worker.errors import WorkerError

REASONS = sorted(v for k, v in vars(reasons).items() if k.isupper() and isinstance(v, str))
WORKER = Path(__file__).resolve().parents[1] / "worker"


def test_every_reason_has_a_status_and_the_table_names_no_other() -> None:
    assert len(REASONS) > 30
    assert set(STATUS_BY_REASON) == set(REASONS)
    assert set(RELAYED_STATUS_BY_REASON) == set(REASONS)


def test_the_coordinator_differs_only_where_a_workers_own_fault_is_its_bad_gateway() -> None:
    differ = {r: (STATUS_BY_REASON[r], RELAYED_STATUS_BY_REASON[r]) for r in REASONS
              if STATUS_BY_REASON[r] != RELAYED_STATUS_BY_REASON[r]}
    assert differ == {reasons.ENGINE_FAILED: (500, 502), reasons.PROTOCOL_MISMATCH: (400, 502)}


@pytest.mark.parametrize("reason", REASONS)
def test_both_services_take_a_reasons_status_from_the_one_table(reason: str) -> None:
    assert WorkerError(reason, "x").status == STATUS_BY_REASON[reason]
    assert CoordinatorError(reason, "x").status == RELAYED_STATUS_BY_REASON[reason]
    answer = WorkerError(reason, "x").to_response("r")
    assert answer.status_code == STATUS_BY_REASON[reason]
    assert ("retry-after" in answer.headers) == (answer.status_code == 503)


def test_the_coordinators_table_is_the_protocols() -> None:
    assert coordinator_errors.STATUS_BY_REASON is RELAYED_STATUS_BY_REASON


def test_a_swap_refusal_is_503_everywhere() -> None:
    """It was 409 from a worker's load route and the coordinator, 503 from its admission."""
    assert STATUS_BY_REASON[reasons.MODEL_SWAPPING] == RELAYED_STATUS_BY_REASON[reasons.MODEL_SWAPPING] == 503


def test_starlettes_own_refusals_keep_their_status() -> None:
    assert (WorkerError.from_http(405, "x").status, WorkerError.from_http(405, "x").reason) == (405, "invalid_request")
    assert (WorkerError.from_http(500, "x").status, WorkerError.from_http(500, "x").reason) == (500, "internal")


def _worker_error_calls() -> list[tuple[str, ast.Call]]:
    calls = []
    for path in sorted(WORKER.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "WorkerError":
                calls.append((f"{path.relative_to(WORKER.parent)}:{node.lineno}", node))
    return calls


def test_no_worker_error_types_a_status() -> None:
    """Every `WorkerError(...)` in worker/ names a reason of protocol.reasons, and nothing else decides
    its status."""
    calls = _worker_error_calls()
    assert len(calls) > 40
    typed = [where for where, call in calls if len(call.args) != 2 or call.keywords
             or not (isinstance(call.args[0], ast.Attribute) and isinstance(call.args[0].value, ast.Name)
                     and call.args[0].value.id == "reasons" and hasattr(reasons, call.args[0].attr))]
    assert typed == []
