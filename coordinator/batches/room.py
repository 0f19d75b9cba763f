"""Whether the pool has room for one more batch request now: the pace of a batch job (runner.py).

Owns: the question a job asks before it starts another line: nobody waits in the queue for the line's
model (an interactive request waiting is served first, and a batch line would only queue behind it),
and admission's O(1) check (admission/capacity.py) would let a new request of the batch's tenant in
now (a free sequence and its KV on some worker, and the fair-share headroom: a tenant past its share
leaves the last sequences to the others). An embedding line asks the embedding admission.
Must not: admit, reserve or count anything: the line's own request does that, through the gateway.
A line whose model cannot be told (unknown, none served) has room: its request's refusal is its answer.
"""

from __future__ import annotations

import json

from coordinator.admission.demand import Demand
from coordinator.batches.runner import Room
from coordinator.errors import CoordinatorError
from coordinator.pool.models import resolve_model
from coordinator.state import CoordinatorState
from protocol.batches import ENDPOINTS

EMBEDDINGS = "/v1/embeddings"
assert EMBEDDINGS in ENDPOINTS


def room_in(state: CoordinatorState) -> Room:
    def has_room(endpoint: str, body: bytes, tenant: str) -> bool:
        try:
            named = json.loads(body).get("model")
            model = resolve_model(state.registry, state.settings.default_model, named if isinstance(named, str) else None,
                                  any_name=state.settings.any_model_name)
        except (ValueError, AttributeError, CoordinatorError):
            return True
        if model is None:
            return True
        try:
            if endpoint == EMBEDDINGS:
                state.embedding_admission.check(model)
                return True
            if state.queue.waiting(model):
                return False
            state.admission.check(Demand(prompt_bytes=len(body), max_tokens=1), model, tenant)
        except CoordinatorError:
            return False
        return True

    return has_room
