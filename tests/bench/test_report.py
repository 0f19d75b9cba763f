"""bench.load.report: the per-point block, the sweep table, and the JSON file read back."""

from __future__ import annotations

from pathlib import Path

from bench.load.record import Failure, RequestRecord
from bench.load.report import point_block, read_json, sweep_table, write_json
from bench.load.runner import Point, PointResult
from bench.load.stats import Slo, summarize


def point(level: int, slo: Slo | None = None) -> PointResult:
    records = [RequestRecord(i, event_times=[0.1 * level, 0.1 * level + 0.01], e2e=0.1 * level + 0.02, tokens=3)
               for i in range(4)]
    records.append(RequestRecord(4).fail(Failure.HTTP, "kv_full", status=503))
    return PointResult(Point("closed", level, 5), summarize(records, 2.0, slo), records)


def test_point_block() -> None:
    block = point_block(point(2), "ours").splitlines()
    assert block[0].startswith("[ours] c=2: 5 requests (4 ok, 1 failed) in 2.00 s   2.00 req/s   6.0 tok/s")
    assert "goodput" not in block[0]  # no SLO given: nothing to report
    ttft = next(line for line in block if line.strip().startswith("TTFT")).split()
    assert ttft[1:4] == ["200.0", "200.0", "200.0"] and ttft[-1] == "4"
    assert block[-1] == "  errors: http 503 kv_full x1"
    with_slo = point_block(point(2, Slo(ttft_ms=150)))
    assert "goodput 0.00 req/s (0% within TTFT<=150 ms)" in with_slo
    assert "(80% within TTFT<=500 ms, TPOT<=100 ms)" in point_block(point(2, Slo(500, 100)))


def test_sweep_table_has_a_row_per_point() -> None:
    rows = sweep_table([point(1), point(8)]).splitlines()
    assert len(rows) == 4
    assert rows[2].split()[:4] == ["c=1", "4/5", "2.00", "6.0"]
    assert rows[3].split()[0] == "c=8" and rows[3].split()[-1] == "1"  # errors


def test_json_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "r.json"
    ours, peer = [point(1, Slo(100, 20)), point(4)], [point(1)]
    write_json(path, {"url": "http://127.0.0.1:1"}, {"ours": ours, "peer": peer}, extra={"ratios": []})
    back = read_json(path)
    assert list(back) == ["ours", "peer"]
    assert [r.summary for r in back["ours"]] == [r.summary for r in ours]
    assert [r.point for r in back["peer"]] == [r.point for r in peer]
