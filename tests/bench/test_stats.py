"""Percentiles, per-request metrics, throughput, goodput and error counting of bench.load.stats."""

from __future__ import annotations

import pytest

from bench.load.record import Failure, RequestRecord
from bench.load.stats import Slo, percentiles, summarize


def done(index: int, times: list[float], e2e: float, tokens: int) -> RequestRecord:
    return RequestRecord(index, event_times=times, e2e=e2e, tokens=tokens)


def test_percentiles_use_linear_interpolation_and_report_ms() -> None:
    p = percentiles([i / 1000 for i in range(1, 101)])  # 1..100 ms, given in seconds
    assert (p.p50, p.p90, p.p99) == pytest.approx((50.5, 90.1, 99.01))
    assert p.mean == pytest.approx(50.5)
    assert p.count == 100


def test_percentiles_of_nothing_are_none() -> None:
    p = percentiles([])
    assert (p.p50, p.p90, p.p99, p.mean, p.count) == (None, None, None, None, 0)


def test_single_value_is_every_percentile() -> None:
    p = percentiles([0.25])
    assert (p.p50, p.p90, p.p99) == (250.0, 250.0, 250.0)


def test_request_metrics_ttft_itl_tpot() -> None:
    # 4 tokens in 3 events (the last event carries two tokens): ITL is per event, TPOT per token.
    r = done(0, [0.100, 0.130, 0.190], e2e=0.200, tokens=4)
    assert r.ttft == 0.100
    assert r.itl == pytest.approx([0.030, 0.060])
    assert r.tpot == pytest.approx((0.200 - 0.100) / 3)


@pytest.mark.parametrize("tokens,times", [(1, [0.1]), (0, [])])
def test_tpot_is_undefined_below_two_tokens(tokens: int, times: list[float]) -> None:
    assert done(0, times, e2e=0.2, tokens=tokens).tpot is None


GOOD = done(0, [0.100, 0.110], e2e=0.120, tokens=3)  # TTFT 100 ms, TPOT 10 ms
SLOW_START = done(1, [0.600, 0.610], e2e=0.620, tokens=3)  # TTFT 600 ms, TPOT 10 ms
SLOW_DECODE = done(2, [0.100, 0.200], e2e=0.300, tokens=3)  # TTFT 100 ms, TPOT 100 ms
ONE_TOKEN = done(3, [0.100], e2e=0.100, tokens=1)  # no TPOT: cannot miss it
FAILED = RequestRecord(4).fail(Failure.HTTP, "kv_full", status=503)


@pytest.mark.parametrize("slo,met", [
    (Slo(), [True, True, True, True, False]),
    (Slo(ttft_ms=500), [True, False, True, True, False]),
    (Slo(tpot_ms=50), [True, True, False, True, False]),
    (Slo(ttft_ms=500, tpot_ms=50), [True, False, False, True, False]),
    (Slo(ttft_ms=100, tpot_ms=10), [True, False, False, True, False]),  # bounds are inclusive
])
def test_slo_table(slo: Slo, met: list[bool]) -> None:
    records = [GOOD, SLOW_START, SLOW_DECODE, ONE_TOKEN, FAILED]
    assert [slo.met_by(r) for r in records] == met


def test_summary_throughput_goodput_and_errors() -> None:
    records = [GOOD, SLOW_START, SLOW_DECODE, ONE_TOKEN, FAILED,
               RequestRecord(5).fail(Failure.HTTP, "kv_full", status=503),
               RequestRecord(6).fail(Failure.STREAM, "deadline_exceeded"),
               RequestRecord(7).fail(Failure.TIMEOUT)]
    s = summarize(records, duration_s=2.0, slo=Slo(ttft_ms=500, tpot_ms=50))
    assert (s.requests, s.successes, s.failures) == (8, 4, 4)
    assert s.requests_per_s == pytest.approx(2.0)
    assert s.output_tokens == 10
    assert s.tokens_per_s == pytest.approx(5.0)
    assert s.goodput_rps == pytest.approx(1.0)  # GOOD and ONE_TOKEN
    assert s.slo_attainment == pytest.approx(2 / 8)
    assert s.errors == {"http 503 kv_full": 2, "stream deadline_exceeded": 1, "timeout": 1}
    assert s.ttft_ms.count == 4 and s.ttft_ms.p50 == pytest.approx(100.0)
    assert s.itl_ms.count == 3  # gaps of the successful requests only
    assert s.tpot_ms.count == 3


def test_summary_counts_token_mismatches_and_survives_no_requests() -> None:
    mismatched = done(0, [0.1, 0.2], e2e=0.3, tokens=3)
    mismatched.token_mismatch = True
    assert summarize([mismatched], 1.0).token_mismatches == 1
    empty = summarize([], 0.0)
    assert (empty.requests, empty.requests_per_s, empty.slo_attainment) == (0, 0.0, None)
