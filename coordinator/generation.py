"""`Generation`: the one internal request that every public surface produces and the core consumes.

Owns: bundling a validated `protocol.worker.GenerateRequest` with its request id, the exact bytes
posted to workers, and its capacity demand.
Must not: parse any public wire format (surfaces do) or admit anything (gateway.py does).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from coordinator.admission.demand import Demand
from protocol.seeds import choice_seed
from protocol.worker import GenerateRequest
from serving.tracing import NO_TRACE, Trace

SessionKey = tuple[str, str]  # (tenant, session id): ids are per tenant

@dataclass(frozen=True, slots=True)
class Generation:
    """The internal request every surface produces: validated, with its worker payload and demand."""

    request: GenerateRequest
    request_id: str
    payload: bytes  # the JSON posted to the worker: only the fields the client set
    demand: Demand
    surface: str  # for the log line: which public API it came through
    priority: str = ""  # the priority class it asked for; "": its key's default (admission/priority.py)
    trace: Trace = NO_TRACE  # its spans, when this coordinator traces (serving/tracing.py; the gateway begins it)
    prefer: str | None = None  # a worker holding its conversation's KV (a stored response's): first if it fits
    avoid: frozenset[str] = frozenset()  # workers it must not go to (a continuation's failed ones)

    @property
    def session_key(self) -> SessionKey | None:
        """The session this request continues or starts, as its tenant knows it; None: one-shot."""
        session_id = self.request.session_id
        return (self.request.tenant, session_id) if session_id is not None else None

    def disaggregated(self, threshold: int, workers: int) -> bool:
        """Whether it is prefilled on one worker and decoded on another (DISAGGREGATE_PROMPT_BYTES, the
        `threshold`; 0: never): a new one-shot request with a long prompt, and two workers to do it."""
        return (threshold > 0 and self.demand.prompt_bytes >= threshold and self.request.session_id is None
                and self.request.n == 1 and not self.request.generated and workers >= 2)

    def classed(self, name: str) -> Generation:
        """Itself at priority class `name` (admission/priority.py): a batch request is sent as such (a
        worker may park it for an interactive one); an interactive one may park one
        (`Demand.preempts`)."""
        if name == "batch":
            return self._changed(priority=name)
        return dataclasses.replace(self, demand=dataclasses.replace(self.demand, preempts=True))

    def not_continued(self, *, session_held: bool) -> str:
        """Why it may not go on on another worker should its worker fail mid-stream (relay/continuation.py);
        "" when it may. `session_held`: its kept session lives on a worker already, with the history of its
        earlier turns, which dies with that worker (a session's first turn has its whole history here)."""
        if self.request.session_id is not None and session_held:
            return "a kept session's later turn is not continued on another worker (its history was there)"
        return ""

    def tracked(self) -> Generation:
        """Itself asking its worker for the token ids of each token event (`token_ids`), which a
        continuation needs."""
        return dataclasses.replace(self, payload=self.payload[:-1] + b',"token_ids":true}')

    def continued(self, generated: list[int], avoid: frozenset[str], choice: int = 0) -> Generation:
        """The rest of itself (of its choice `choice`, when it has several) after its worker failed: the tokens
        its client has (`generated`), prefilled after the prompt by a worker not in `avoid`, which generates on
        from there (its prompt not scored again). A choice goes on alone (n = 1), drawing from the seed the
        worker gave it (protocol/seeds.py), or from fresh entropy when the request named none."""
        update: dict[str, object] = {"generated": generated, "token_ids": True}
        if self.request.prompt_logprobs is not None:
            update["prompt_logprobs"] = None  # scored and sent already
        if self.request.n > 1:
            update["n"] = 1
            if self.request.seed is not None:
                update["seed"] = choice_seed(self.request.seed, choice)
        request = self.request.model_copy(update=update)
        payload = request.model_dump_json(exclude_unset=True).encode()
        demand = dataclasses.replace(self.demand, prompt_bytes=self.demand.prompt_bytes + len(generated), choices=1)
        return dataclasses.replace(self, request=request, payload=payload, demand=demand, avoid=avoid)

    def weighted(self, weight: float, *, headroom: bool = False) -> Generation:
        """Itself telling its worker its tenant's fair-share weight (the worker's line applies it) and,
        with `headroom`, that the worker keeps headroom for the other tenants (worker/headroom.py)."""
        fields: dict[str, object] = {"tenant_weight": weight} if weight != 1.0 else {}  # 1: the worker's default
        return self._changed(**fields, **({"fair_share": True} if headroom else {}))

    def for_model(self, name: str) -> Generation:
        """Itself naming the served model `name` (a name the pool took for it: pool/models.py)."""
        return self._changed(model=name)

    def _changed(self, **fields: object) -> Generation:
        """Itself with some of its request's fields changed, and its payload made again from the request."""
        request = self.request.model_copy(update=fields)
        return dataclasses.replace(self, request=request, payload=request.model_dump_json(exclude_unset=True).encode())

    @classmethod
    def of(cls, request: GenerateRequest, request_id: str, surface: str, priority: str = "") -> Generation:
        demand = Demand(request.prompt_bytes(), request.max_tokens, messages=len(request.messages or ()),
                        choices=request.n)
        payload = request.model_dump_json(exclude_unset=True).encode()
        return cls(request, request_id, payload, demand, surface, priority)
