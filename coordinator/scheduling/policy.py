"""The scheduling policy: filters, then weighted scorers, then a picker. `select` is pure.

Owns: running the filters in order (the first that leaves nobody gives the answer's reason), the
weighted sum of the scorers (weights come from settings), the picker that orders the survivors (the
named routing policy: by default the lowest total first, ties to the lower worker id, so the same
inputs always give the same answer), session affinity (a hard rule) and conversation preference (a
soft one). Every policy passes the same filters. Embedding requests have a policy of their own
(`build_embeddings`): the same picker, filters for embedding slots instead of sequences and KV,
and scorers for the embedder's queue and the decode loop's load, since both share the worker's cores.
So do the tokenizer's requests (`build_tokenizer`), which hold nothing on a worker.
Must not: do I/O, read a clock or random source it was not given, or change the workers it reads.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from coordinator.scheduling import catalog
from coordinator.scheduling.filters import Filter
from coordinator.scheduling.filters.alive import Alive
from coordinator.scheduling.filters.serves_model import ServesModel
from coordinator.scheduling.pickers import Picker
from coordinator.scheduling.pickers.least_connections import LeastConnections
from coordinator.scheduling.pickers.score import ByScore
from coordinator.scheduling.plugin import BOTH, EMBEDDINGS, GENERATION, Options
from coordinator.scheduling.scorers import Scorer
from coordinator.scheduling.view import Decision, Request, WorkerView
from protocol import reasons

DEFAULT_SCORERS = "session_load:0.6,kv_load:0.4"
# Embedding requests: half their own queue's load, half the decode loop's (sequences in use), since an
# embedding batch and a decode step compete for the same cores.
EMBEDDING_SCORERS = "embedding_load:0.5,session_load:0.5"


@dataclass(frozen=True)
class Policy:
    filters: tuple[Filter, ...]
    scorers: tuple[tuple[Scorer, float], ...]
    # An affinity scorer (prefix) gives no credit to a worker whose load cost is more than this above
    # the least loaded candidate's: balance wins over a cached prefix past that point.
    balance_threshold: float = 0.3
    picker: Picker = field(default_factory=ByScore)

    @classmethod
    def build(cls, *, stale_after: float, scorers: str = DEFAULT_SCORERS, balance_threshold: float = 0.3,
              routing: str = "score", latency_half_life: float = 10.0) -> Policy:
        """The policy of generations: every filter registered for them, in order (catalog.py), the
        scorers `scorers` names with their weights, and the picker `routing` names."""
        options = Options(stale_after=stale_after, latency_half_life=latency_half_life)
        filters = _filters(GENERATION, options)
        pickers = catalog.pickers()
        if routing not in pickers:
            raise ValueError(f"unknown routing policy {routing!r} (known: {', '.join(pickers)})")
        return cls(filters, parse_scorers(scorers, options), balance_threshold, pickers[routing].build(options))

    @classmethod
    def build_embeddings(cls, *, stale_after: float, routing: str = "score",
                         latency_half_life: float = 10.0) -> Policy:
        """The policy of embedding requests: only workers that embed and have a free embedding slot."""
        options = Options(stale_after=stale_after, latency_half_life=latency_half_life)
        generation = cls.build(stale_after=stale_after, routing=routing, latency_half_life=latency_half_life)
        return cls(_filters(EMBEDDINGS, options), parse_scorers(EMBEDDING_SCORERS, options, kind=EMBEDDINGS),
                   picker=generation.picker)

    @classmethod
    def build_tokenizer(cls, *, stale_after: float) -> Policy:
        """The policy of tokenizer requests (/tokenize, /detokenize, /tokenizer_info), which hold no
        sequence, KV or embedding slot: the filters every kind of request passes (alive, the model, not
        draining, the breaker closed), no scorer, and the fewest of this coordinator's streams first."""
        options = Options(stale_after=stale_after)
        found = catalog.filters()
        shared = [name for name in catalog.named(GENERATION, found) if found[name].kinds >= BOTH]
        return cls(tuple(found[name].build(options) for name in shared), (), picker=LeastConnections())

    def uses(self, name: str) -> bool:
        return any(s.name == name for s, _ in self.scorers)

    def score(self, request: Request, worker: WorkerView) -> tuple[float, dict[str, float]]:
        """The weighted total (lower is better) and each scorer's weighted part of it."""
        parts = {s.name: weight * s.score(request, worker) for s, weight in self.scorers}
        return sum(parts.values()), parts

    def _balanced(self, scored: dict[str, tuple[float, dict[str, float]]]) -> dict[str, tuple[float, dict[str, float]]]:
        """Affinity parts count only for workers within `balance_threshold` of the least loaded."""
        affinity = {s.name: weight for s, weight in self.scorers if getattr(s, "affinity", False)}
        load_weight = sum(weight for s, weight in self.scorers if s.name not in affinity)
        if not affinity or load_weight <= 0 or len(scored) < 2:
            return scored

        def load(parts: dict[str, float]) -> float:
            return sum(v for k, v in parts.items() if k not in affinity) / load_weight

        least = min(load(parts) for _, parts in scored.values())
        out = {}
        for worker_id, (total, parts) in scored.items():
            if load(parts) - least > self.balance_threshold:
                parts = {**parts, **affinity}  # full cost: no credit for what it may hold
                total = sum(parts.values())
            out[worker_id] = (total, parts)
        return out

    def select(self, request: Request, workers: Iterable[WorkerView], *, now: float) -> Decision:
        """Filter, score, rank. `now` is monotonic seconds, as in `last_seen`."""
        if request.session_worker is not None:
            return self._affinity(request, workers, now)
        left: Sequence[WorkerView] = list(workers)
        for f in self.filters:
            left = [w for w in left if f.keep(request, w, now)]
            if not left:
                return Decision(reason=f.reason)
        scored = self._balanced({w.worker_id: self.score(request, w) for w in left})
        picked = self.picker.rank(request, left, {k: v[0] for k, v in scored.items()}, now)
        # A stable sort: the preferred worker first, the picker's order otherwise kept.
        ranked = tuple(sorted(picked, key=lambda w: w.worker_id != request.prefer))
        return Decision(ranked=ranked, scores={k: v[0] for k, v in scored.items()},
                        parts={k: v[1] for k, v in scored.items()})

    def _affinity(self, request: Request, workers: Iterable[WorkerView], now: float) -> Decision:
        """A known session goes to its worker or nowhere: its KV cache lives there and nowhere else.

        Only liveness and the model are checked: the session already holds its slot, and the worker
        itself answers 503/413 if the next turn does not fit.
        """
        alive, model = next(f for f in self.filters if isinstance(f, Alive)), ServesModel()
        for w in workers:
            if w.worker_id == request.session_worker:
                if alive.keep(request, w, now) and model.keep(request, w, now):
                    total, parts = self.score(request, w)
                    return Decision(ranked=(w,), scores={w.worker_id: total}, parts={w.worker_id: parts})
                break
        return Decision(reason=reasons.UNKNOWN_SESSION)


def parse_scorers(spec: str, options: Options | None = None, *,
                  kind: str = GENERATION) -> tuple[tuple[Scorer, float], ...]:
    """`name:weight,...` -> scorers with their weights; a ValueError names what is wrong."""
    known = catalog.named(kind, catalog.scorers())
    out: list[tuple[Scorer, float]] = []
    for item in (part.strip() for part in spec.split(",")):
        if not item:
            continue
        name, sep, weight = item.partition(":")
        if name not in known:
            raise ValueError(f"unknown scorer {name!r} (known: {', '.join(known)})")
        try:
            value = float(weight) if sep else 1.0
        except ValueError:
            raise ValueError(f"scorer {name!r}: weight {weight!r} is not a number") from None
        if not 0.0 <= value <= 100.0:
            raise ValueError(f"scorer {name!r}: weight must be between 0 and 100")
        out.append((catalog.scorers()[name].build(options or Options()), value))
    if not out:
        raise ValueError("at least one scorer is needed")
    return tuple(out)


def _filters(kind: str, options: Options) -> tuple[Filter, ...]:
    found = catalog.filters()
    return tuple(found[name].build(options) for name in catalog.named(kind, found))
