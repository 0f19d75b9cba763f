"""Scheduling in the llm-d endpoint-picker shape: filters (filters/), weighted scorers (scorers/),
and the policy that runs them (policy.py). Pure: no I/O, no clock of its own."""

from coordinator.scheduling.policy import DEFAULT_SCORERS, Policy, parse_scorers
from coordinator.scheduling.view import Decision, Request, WorkerView

__all__ = ["DEFAULT_SCORERS", "Decision", "Policy", "Request", "WorkerView", "parse_scorers"]
