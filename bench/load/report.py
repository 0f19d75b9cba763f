"""Human and machine output of a run: a block per point, a sweep table, the JSON file.

Owns: formatting and the JSON layout (`{"config": ..., "targets": {name: [point, ...]}}`).
Must not: compute metrics (stats.py) or draw (plot.py).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from bench.load.runner import PointResult


def num(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def point_block(result: PointResult, target: str = "") -> str:
    """A few lines for one point: counts and throughput, then one row of percentiles per latency."""
    s = result.summary
    name = f"[{target}] " if target else ""
    slo = ""
    bounds = [f"{metric}<={limit:g} ms" for metric, limit in (("TTFT", s.slo.ttft_ms), ("TPOT", s.slo.tpot_ms))
              if limit is not None]
    if bounds:
        slo = (f"   goodput {s.goodput_rps:.2f} req/s ({100 * (s.slo_attainment or 0):.0f}% within "
               f"{', '.join(bounds)})")
    title = (f"{name}{result.point.label}: {s.requests} requests ({s.successes} ok, {s.failures} failed) "
             f"in {s.duration_s:.2f} s   {s.requests_per_s:.2f} req/s   {s.tokens_per_s:.1f} tok/s "
             f"({s.output_tokens} tokens){slo}")
    lines = [title,
             f"  {'ms':<6}{'p50':>10}{'p90':>10}{'p99':>10}{'mean':>10}{'n':>8}"]
    for label, p in (("TTFT", s.ttft_ms), ("TPOT", s.tpot_ms), ("ITL", s.itl_ms), ("e2e", s.e2e_ms)):
        lines.append(f"  {label:<6}{num(p.p50):>10}{num(p.p90):>10}{num(p.p99):>10}{num(p.mean):>10}{p.count:>8}")
    if s.errors:
        lines.append("  errors: " + ", ".join(f"{key} x{n}" for key, n in s.errors.items()))
    if s.token_mismatches:
        lines.append(f"  token count mismatches (done usage vs token indices): {s.token_mismatches}")
    return "\n".join(lines)


def sweep_table(results: Sequence[PointResult]) -> str:
    """One row per point: the numbers a sweep is read for."""
    head = (f"{'point':<12}{'ok/all':>9}{'req/s':>8}{'tok/s':>9}{'goodput':>9}{'TTFT p50':>10}{'p90':>8}"
            f"{'p99':>8}{'ITL p50':>9}{'p99':>8}{'TPOT p50':>10}{'e2e p50':>9}{'p99':>8}  errors")
    rows = [head, "-" * len(head)]
    for r in results:
        s = r.summary
        rows.append(f"{r.point.label:<12}{f'{s.successes}/{s.requests}':>9}{s.requests_per_s:>8.2f}"
                    f"{s.tokens_per_s:>9.1f}{s.goodput_rps:>9.2f}{num(s.ttft_ms.p50):>10}{num(s.ttft_ms.p90):>8}"
                    f"{num(s.ttft_ms.p99):>8}{num(s.itl_ms.p50):>9}{num(s.itl_ms.p99):>8}"
                    f"{num(s.tpot_ms.p50):>10}{num(s.e2e_ms.p50):>9}{num(s.e2e_ms.p99):>8}  "
                    f"{sum(s.errors.values()) or ''}")
    return "\n".join(rows)


def point_json(result: PointResult) -> dict[str, Any]:
    p = result.point
    return {"label": p.label, "mode": p.mode, "level": p.level, "requests": p.requests,
            "duration_s": p.duration, "summary": dataclasses.asdict(result.summary)}


def write_json(path: Path, config: Mapping[str, Any], targets: Mapping[str, Sequence[PointResult]],
               extra: Mapping[str, Any] | None = None) -> None:
    document: dict[str, Any] = {"tool": "bench.load", "config": dict(config),
                                "targets": {name: [point_json(r) for r in rs] for name, rs in targets.items()}}
    document.update(extra or {})
    path.write_text(json.dumps(document, indent=2) + "\n")



def read_json(path: Path) -> dict[str, list[PointResult]]:
    """The targets of a JSON file `write_json` wrote, as point results without their request records
    (enough to print or plot a saved run again)."""
    from bench.load.runner import Point
    from bench.load.stats import Percentiles, Slo, Summary

    def result(p: dict[str, Any]) -> PointResult:
        fields = dict(p["summary"])
        for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
            fields[key] = Percentiles(**fields[key])
        fields["slo"] = Slo(**fields["slo"])
        return PointResult(Point(p["mode"], p["level"], p["requests"], p["duration_s"]), Summary(**fields))

    document = json.loads(path.read_text())
    return {name: [result(p) for p in points] for name, points in document["targets"].items()}
