"""Comparison mode: ratios, the ratio table, the peer's command line as llama_cpp.server parses it,
and the interleaving of points between ours and the peer."""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path

import httpx
import pytest

from bench.load.clients import InferClient, OpenAIClient, Sampling
from bench.load.compare import Ratio, ratio, ratio_table, ratios, run_both
from bench.load.peer import LlamaCppServer
from bench.load.record import RequestRecord
from bench.load.runner import Point, PointResult, Runner
from bench.load.stats import summarize
from bench.load.workload import Workload


def result(level: int, requests: int, wall: float, ttft: float) -> PointResult:
    records = [RequestRecord(i, event_times=[ttft, ttft + 0.01], e2e=ttft + 0.02, tokens=10)
               for i in range(requests)]
    return PointResult(Point("closed", level, requests), summarize(records, wall), records)


def test_ratios_are_ours_over_theirs() -> None:
    rows = ratios([result(40, 40, 1.0, 0.1)], [result(40, 40, 4.0, 0.4)])
    r = rows[0]
    assert r.label == "c=40"
    assert r.rps == pytest.approx(4.0) and r.tps == pytest.approx(4.0)
    assert r.ttft_p50 == pytest.approx(0.25) and r.ttft_p99 == pytest.approx(0.25)
    assert r.as_json()["requests_per_s"] == [pytest.approx(40.0), pytest.approx(10.0), pytest.approx(4.0)]


@pytest.mark.parametrize("ours,theirs,expected", [(2.0, 1.0, 2.0), (1.0, 0.0, None), (None, 1.0, None)])
def test_ratio_guards(ours: float | None, theirs: float | None, expected: float | None) -> None:
    assert ratio(ours, theirs) == expected


def test_ratio_table_shows_both_sides_and_the_ratio() -> None:
    table = ratio_table([Ratio("c=40", 12.0, 3.0, 120.0, 30.0, 50.0, 200.0, None, 400.0)])
    row = table.splitlines()[2]
    assert row.startswith("c=40")
    assert "4.00x" in row and "0.25x" in row and "12.00" in row and "3.00" in row
    assert row.rstrip().endswith("-")  # no ours p99: no ratio


def test_peer_command_line_is_one_llama_cpp_server_accepts() -> None:
    from llama_cpp.server.cli import add_args_from_model, parse_model_from_args
    from llama_cpp.server.settings import ModelSettings, ServerSettings, Settings

    peer = LlamaCppServer(Path("/models/m.gguf"), threads=3, port=4321, n_ctx=1024)
    argv = peer.argv()
    assert argv[1:3] == ["-m", "llama_cpp.server"]
    parser = argparse.ArgumentParser()
    add_args_from_model(parser, Settings)
    args = parser.parse_args(argv[3:])
    server = parse_model_from_args(ServerSettings, args)
    model = parse_model_from_args(ModelSettings, args)
    assert (server.host, server.port, server.interrupt_requests) == ("127.0.0.1", 4321, False)
    assert (model.model, model.n_threads, model.n_threads_batch, model.n_ctx) == ("/models/m.gguf", 3, 3, 1024)
    assert peer.url == "http://127.0.0.1:4321"


def test_each_point_runs_against_ours_then_the_peer() -> None:
    calls: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request.url.path)
        if request.url.path == "/v1/completions":
            body = b'data: {"choices": [{"text": "a", "finish_reason": "stop"}]}\n\ndata: [DONE]\n\n'
        else:
            body = (b'event: token\ndata: {"token": "a", "index": 0, "probability": 1}\n\n'
                    b'event: done\ndata: {"usage": {"completion_tokens": 1}}\n\n')
        return httpx.Response(200, content=body)

    transport = httpx.MockTransport(handler)
    ours = Runner(InferClient("http://127.0.0.1:1", Sampling()), Workload(), progress=False, transport=transport)
    theirs = Runner(OpenAIClient("http://127.0.0.1:2", Sampling()), Workload(), progress=False,
                    transport=transport)
    points = [Point("closed", 1, 2), Point("closed", 2, 2)]
    seen: list[tuple[str, str]] = []
    mine, peer = asyncio.run(run_both(ours, theirs, points, on_point=lambda name, r: seen.append((name, r.point.label))))
    assert seen == [("ours", "c=1"), ("llama_cpp.server", "c=1"), ("ours", "c=2"), ("llama_cpp.server", "c=2")]
    assert [r.summary.successes for r in mine + peer] == [2, 2, 2, 2]
    assert calls == ["/coordinator/infer"] * 2 + ["/v1/completions"] * 2 + ["/coordinator/infer"] * 2 + \
        ["/v1/completions"] * 2
