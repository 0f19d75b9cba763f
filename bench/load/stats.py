"""Aggregates one point's request records: latency percentiles, throughput, goodput, errors.

Owns: the definitions (below) and the numbers in a `Summary`.
Must not: do I/O or formatting (report.py does).

Definitions (times from the client's side, in ms):
- TTFT: send until the first token event.            - ITL: gaps between successive token events.
- TPOT: (e2e - TTFT) / (tokens - 1), per request.    - e2e: send until the final event.
- requests/s and tokens/s: successful requests and their generated tokens over the point's wall time.
- goodput: successful requests that met every given SLO (TTFT and TPOT), per second of wall time.
Latency percentiles are over successful requests (ITL pools every gap of every successful request).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from bench.load.record import RequestRecord

QUANTILES = (50, 90, 99)


@dataclass(frozen=True)
class Percentiles:
    """Milliseconds; None where no request gave a value."""

    p50: float | None = None
    p90: float | None = None
    p99: float | None = None
    mean: float | None = None
    count: int = 0


@dataclass(frozen=True)
class Slo:
    ttft_ms: float | None = None
    tpot_ms: float | None = None

    def met_by(self, record: RequestRecord) -> bool:
        if not record.ok:
            return False
        if self.ttft_ms is not None and (record.ttft is None or record.ttft * 1e3 > self.ttft_ms):
            return False
        tpot = record.tpot  # None for a one-token answer: no time per output token to miss
        return self.tpot_ms is None or tpot is None or tpot * 1e3 <= self.tpot_ms


@dataclass(frozen=True)
class Summary:
    requests: int
    successes: int
    failures: int
    duration_s: float
    requests_per_s: float
    output_tokens: int
    tokens_per_s: float
    goodput_rps: float
    slo_attainment: float | None  # fraction of all requests that met the SLOs
    ttft_ms: Percentiles
    tpot_ms: Percentiles
    itl_ms: Percentiles
    e2e_ms: Percentiles
    errors: dict[str, int] = field(default_factory=dict)
    token_mismatches: int = 0  # ours: the `done` usage disagreed with the token events' indices
    slo: Slo = Slo()


def percentiles(values_s: Iterable[float], quantiles: Sequence[int] = QUANTILES) -> Percentiles:
    """Percentiles (linear interpolation, numpy's default) of values given in seconds, in ms."""
    data = np.fromiter(values_s, dtype=np.float64) * 1e3
    if data.size == 0:
        return Percentiles()
    p50, p90, p99 = (float(v) for v in np.percentile(data, list(quantiles)))
    return Percentiles(p50=p50, p90=p90, p99=p99, mean=float(data.mean()), count=int(data.size))


def summarize(records: Sequence[RequestRecord], duration_s: float, slo: Slo | None = None) -> Summary:
    slo = slo or Slo()
    ok = [r for r in records if r.ok]
    tokens = sum(r.tokens for r in ok)
    good = sum(1 for r in ok if slo.met_by(r))
    per_s = 1.0 / duration_s if duration_s > 0 else 0.0
    return Summary(
        requests=len(records),
        successes=len(ok),
        failures=len(records) - len(ok),
        duration_s=duration_s,
        requests_per_s=len(ok) * per_s,
        output_tokens=tokens,
        tokens_per_s=tokens * per_s,
        goodput_rps=good * per_s,
        slo_attainment=good / len(records) if records else None,
        ttft_ms=percentiles(r.ttft for r in ok if r.ttft is not None),
        tpot_ms=percentiles(t for r in ok if (t := r.tpot) is not None),
        itl_ms=percentiles(gap for r in ok for gap in r.itl),
        e2e_ms=percentiles(r.e2e for r in ok if r.e2e is not None),
        errors=dict(Counter(r.error_key for r in records if not r.ok).most_common()),
        token_mismatches=sum(1 for r in ok if r.token_mismatch),
        slo=slo,
    )
