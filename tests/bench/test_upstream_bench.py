"""The worker-client benchmark runs end to end on loopback and prints both clients and the ratio."""

from __future__ import annotations

import re

import pytest

from bench import upstream_bench


def test_measures_both_clients_over_every_event(capsys: pytest.CaptureFixture[str]) -> None:
    assert upstream_bench.main(["--events", "300", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    for name in ("httpx", "aiohttp"):
        assert re.search(rf"^{name} +300 events in \d+ reads: [\d.]+ us", out, re.MULTILINE), out
    assert re.search(r"aiohttp costs [\d.]+ of httpx's CPU", out), out
