"""Comparison mode: the same workload points against this project and against a peer server
(llama_cpp.server, or llama.cpp's own llama-server).

Owns: preparing prompts so both servers see the same text (the model's chat template rendered here;
ours gets `raw: true`), the ban list that stands in for `ignore_eos` on the peer (the model's
end-of-generation tokens), running each point against ours then the peer, and the ratio table.
Must not: start our service (the caller points --url at it) or define metrics.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from bench.load.runner import Point, PointResult, Runner


@dataclass(frozen=True)
class PreparedPrompts:
    prompts: tuple[str, ...]
    eog_tokens: tuple[int, ...]


def prepare_prompts(model_path: Path, prompts: Sequence[str], *, chat_template: bool) -> PreparedPrompts:
    """Renders each prompt as one user turn with the model's own template (the worker's code does it,
    so ours and the peer complete exactly the same text), and reads the model's end tokens."""
    from worker.backends.llama_model import Message, Model  # llama.cpp is loaded only in comparison mode

    model = Model(model_path)
    try:
        rendered = tuple(model.render_chat([Message("user", p)]) if chat_template else p for p in prompts)
        return PreparedPrompts(rendered, tuple(model.eog_tokens))
    finally:
        model.close()


@dataclass(frozen=True)
class Ratio:
    label: str
    ours_rps: float
    theirs_rps: float
    ours_tps: float
    theirs_tps: float
    ours_ttft_p50: float | None
    theirs_ttft_p50: float | None
    ours_ttft_p99: float | None
    theirs_ttft_p99: float | None

    @property
    def rps(self) -> float | None:
        return ratio(self.ours_rps, self.theirs_rps)

    @property
    def tps(self) -> float | None:
        return ratio(self.ours_tps, self.theirs_tps)

    @property
    def ttft_p50(self) -> float | None:
        return ratio(self.ours_ttft_p50, self.theirs_ttft_p50)

    @property
    def ttft_p99(self) -> float | None:
        return ratio(self.ours_ttft_p99, self.theirs_ttft_p99)

    def as_json(self) -> dict[str, object]:
        return {"label": self.label, "requests_per_s": [self.ours_rps, self.theirs_rps, self.rps],
                "tokens_per_s": [self.ours_tps, self.theirs_tps, self.tps],
                "ttft_p50_ms": [self.ours_ttft_p50, self.theirs_ttft_p50, self.ttft_p50],
                "ttft_p99_ms": [self.ours_ttft_p99, self.theirs_ttft_p99, self.ttft_p99],
                "layout": "[ours, theirs, ours/theirs]"}


def ratio(ours: float | None, theirs: float | None) -> float | None:
    if ours is None or theirs is None or theirs == 0:
        return None
    return ours / theirs


def ratios(ours: Sequence[PointResult], theirs: Sequence[PointResult]) -> list[Ratio]:
    rows = []
    for a, b in zip(ours, theirs):
        sa, sb = a.summary, b.summary
        rows.append(Ratio(a.point.label, sa.requests_per_s, sb.requests_per_s, sa.tokens_per_s, sb.tokens_per_s,
                          sa.ttft_ms.p50, sb.ttft_ms.p50, sa.ttft_ms.p99, sb.ttft_ms.p99))
    return rows


def ratio_table(rows: Sequence[Ratio], peer: str = "llama_cpp.server") -> str:
    def n(v: float | None, width: int, digits: int = 1) -> str:
        return f"{'-':>{width}}" if v is None else f"{v:>{width}.{digits}f}"

    def x(v: float | None) -> str:
        return f"{'-':>7}" if v is None else f"{v:>6.2f}x"

    head = (f"{'point':<11}| {'req/s ours':>10}{'llama':>8}{'ratio':>7} | {'tok/s ours':>10}{'llama':>8}"
            f"{'ratio':>7} | {'TTFT p50 ours':>13}{'llama':>8}{'ratio':>7} | {'TTFT p99 ours':>13}{'llama':>8}"
            f"{'ratio':>7}")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r.label:<11}| {n(r.ours_rps, 10, 2)}{n(r.theirs_rps, 8, 2)}{x(r.rps)} | "
                     f"{n(r.ours_tps, 10)}{n(r.theirs_tps, 8)}{x(r.tps)} | "
                     f"{n(r.ours_ttft_p50, 13)}{n(r.theirs_ttft_p50, 8)}{x(r.ttft_p50)} | "
                     f"{n(r.ours_ttft_p99, 13)}{n(r.theirs_ttft_p99, 8)}{x(r.ttft_p99)}")
    lines.append(f"ratio = ours / {peer}; TTFT in ms (a ratio below 1 is better for TTFT)")
    return "\n".join(lines)


async def run_both(ours: Runner, theirs: Runner, points: Sequence[Point], *,
                   on_point: Callable[[str, PointResult], None] | None = None, peer: str = "llama_cpp.server",
                   ) -> tuple[list[PointResult], list[PointResult]]:
    """Each point against ours, then against the peer (named `peer` to `on_point`), so slow drift of the
    machine hits both alike."""
    mine: list[PointResult] = []
    theirs_results: list[PointResult] = []
    for point in points:
        if ours.remaining <= 0 or theirs.remaining <= 0:
            break
        for name, runner, results in (("ours", ours, mine), (peer, theirs, theirs_results)):
            result = await runner.run(point)
            results.append(result)
            if on_point is not None:
                on_point(name, result)
    return mine, theirs_results
