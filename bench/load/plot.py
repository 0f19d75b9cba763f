"""The PNG of a sweep: throughput, and TTFT/ITL percentiles, against concurrency or rate.

Owns: the figure's layout. Several targets (ours, a peer) share the axes: colour says which metric,
line style which target.
Must not: compute metrics.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only: no display in this environment, and none needed
import matplotlib.pyplot as plt
from matplotlib.ticker import NullLocator

from bench.load.runner import PointResult

STYLES = ("-", "--", ":", "-.")
MARKERS = ("o", "s", "^", "D")
TTFT_COLORS = ("#9ecae1", "#4292c6", "#08519c")  # p50, p90, p99: light to dark
ITL_COLORS = ("#fdae6b", "#f16913", "#a63603")
TOKENS_COLOR = "#2ca02c"
REQUESTS_COLOR = "#9467bd"


def plot_sweep(targets: Mapping[str, Sequence[PointResult]], path: Path, *, title: str = "") -> None:
    first = next((rs for rs in targets.values() if rs), None)
    if first is None:
        raise ValueError("nothing to plot")
    closed = first[0].point.mode == "closed"
    xlabel = "concurrent users (closed loop)" if closed else "arrival rate, requests/s (open loop)"
    fig, (thr, lat) = plt.subplots(1, 2, figsize=(13, 5.2))
    req = thr.twinx()
    for i, (name, results) in enumerate(targets.items()):
        if not results:
            continue
        style, marker = STYLES[i % len(STYLES)], MARKERS[i % len(MARKERS)]
        prefix = f"{name}: " if len(targets) > 1 else ""
        x = [r.point.level for r in results]
        s = [r.summary for r in results]
        thr.plot(x, [v.tokens_per_s for v in s], style, marker=marker, color=TOKENS_COLOR,
                 label=f"{prefix}tokens/s")
        req.plot(x, [v.requests_per_s for v in s], style, marker=marker, color=REQUESTS_COLOR,
                 label=f"{prefix}requests/s")
        for metric, colors in (("ttft_ms", TTFT_COLORS), ("itl_ms", ITL_COLORS)):
            for q, color in zip(("p50", "p90", "p99"), colors):
                lat.plot(x, [getattr(getattr(v, metric), q) for v in s], style, marker=marker, color=color,
                         label=f"{prefix}{metric[:-3].upper()} {q}")
    thr.set(xlabel=xlabel, title="Throughput")
    thr.set_ylabel("generated tokens/s", color=TOKENS_COLOR)
    req.set_ylabel("successful requests/s", color=REQUESTS_COLOR)
    # With a fixed answer length the two curves have the same shape: give them different heights
    # (tokens/s in the upper part, requests/s in the lower half) so neither hides the other.
    thr.set_ylim(0, thr.get_ylim()[1] * 1.1)
    req.set_ylim(0, req.get_ylim()[1] * 2.0)
    handles = thr.get_legend_handles_labels()[0] + req.get_legend_handles_labels()[0]
    # Legends go under the panels: inside, they would cover the highest points.
    below = {"loc": "upper center", "bbox_to_anchor": (0.5, -0.14), "fontsize": 8, "frameon": False}
    thr.legend(handles, [str(h.get_label()) for h in handles], ncol=2, **below)  # type: ignore[arg-type]
    lat.set(xlabel=xlabel, ylabel="milliseconds (log scale)", title="Latency percentiles", yscale="log")
    lat.legend(ncol=2 if len(targets) > 1 else 3, **below)  # type: ignore[arg-type]
    levels = sorted({r.point.level for rs in targets.values() for r in rs})
    for ax in (thr, lat):
        ax.grid(True, alpha=0.3)
        if levels[-1] / levels[0] >= 8:  # a 1..32 sweep: doublings evenly spaced
            ax.set_xscale("log", base=2)
        ax.set_xticks(levels, [f"{v:g}" for v in levels])
        ax.xaxis.set_minor_locator(NullLocator())
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m bench.load.plot results.json results.png`: plots a saved run again."""
    import argparse

    from bench.load.report import read_json

    parser = argparse.ArgumentParser(prog="python -m bench.load.plot", description=main.__doc__)
    parser.add_argument("json", type=Path)
    parser.add_argument("png", type=Path)
    parser.add_argument("--title", default="")
    args = parser.parse_args(argv)
    plot_sweep(read_json(args.json), args.png, title=args.title)
    print(f"wrote {args.png}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
