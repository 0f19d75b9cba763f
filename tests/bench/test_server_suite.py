"""bench.server_suite: a JUnit report read into outcomes, and two targets' outcomes compared."""

from __future__ import annotations

from pathlib import Path

from bench.server_suite import compare, outcomes

REPORT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest">
<testcase classname="unit.test_basic" name="test_health" time="0.1"/>
<testcase classname="unit.test_basic" name="test_props" time="0.1"><failure message="404">x</failure></testcase>
<testcase classname="unit.test_tool_call" name="test_slow" time="0"><skipped message="slow"/></testcase>
<testcase classname="unit.test_basic" name="test_crash" time="0"><error message="boom">y</error></testcase>
</testsuite></testsuites>"""


def test_a_report_gives_each_tests_outcome(tmp_path: Path) -> None:
    report = tmp_path / "r.xml"
    report.write_text(REPORT)
    assert outcomes(report) == {"unit.test_basic::test_health": "passed", "unit.test_basic::test_props": "failed",
                                "unit.test_tool_call::test_slow": "skipped", "unit.test_basic::test_crash": "error"}


def test_the_comparison_puts_each_test_in_one_bucket() -> None:
    peer = {"a": "passed", "b": "passed", "c": "failed", "d": "failed", "e": "skipped", "f": "passed"}
    ours = {"a": "passed", "b": "failed", "c": "passed", "d": "error", "e": "passed"}
    assert compare(peer, ours) == {"both_passed": ["a"], "pool_failed_only": ["b", "f"], "peer_failed_only": ["c"],
                                   "both_failed": ["d"], "skipped": ["e"]}
