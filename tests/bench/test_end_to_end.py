"""The tool end to end: `python -m bench.load`'s main against a small fake SSE server on 127.0.0.1.

The fake speaks this project's `/coordinator/infer` format (token events, then `done`), refuses some
requests with 503 `kv_full` (those whose sampling seed is a multiple of 4: known in advance, since
the workload is seeded) and counts how many requests it serves at once.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from bench.load.command import main
from bench.load.workload import Workload
from tests.threaded_server import serving

TOKEN_DELAY = 0.003


def fake_app(state: dict[str, int]) -> FastAPI:
    app = FastAPI()

    @app.post("/coordinator/infer")
    async def infer(request: Request) -> Response:
        body = await request.json()
        if body["seed"] % 4 == 0:
            return JSONResponse({"error": "full", "reason": "kv_full", "request_id": "x"}, status_code=503)

        async def events() -> AsyncIterator[bytes]:
            state["now"] += 1
            state["peak"] = max(state["peak"], state["now"])
            try:
                yield b": ping\n\n"
                for i in range(body["max_tokens"]):
                    await asyncio.sleep(TOKEN_DELAY)
                    data = {"token": f"t{i}", "index": i, "probability": 0.5, "finished": False}
                    yield f"event: token\ndata: {json.dumps(data)}\n\n".encode()
                done = {"finished": True, "finish_reason": "length", "request_id": "x", "worker_id": "w",
                        "model": "fake", "usage": {"prompt_tokens": 3, "cached_tokens": 0,
                                                   "completion_tokens": body["max_tokens"],
                                                   "total_tokens": 3 + body["max_tokens"]}}
                yield f"event: done\ndata: {json.dumps(done)}\n\n".encode()
            finally:
                state["now"] -= 1

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


@pytest.fixture
def fake_server() -> Iterator[tuple[str, dict[str, int]]]:
    state = {"now": 0, "peak": 0}
    with serving(fake_app(state), lifespan="off") as url:
        yield url, state


def test_closed_loop_sweep_writes_table_json_and_plot(fake_server: tuple[str, dict[str, int]], tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    url, state = fake_server
    out, plot = tmp_path / "r.json", tmp_path / "r.png"
    code = main(["--url", url, "--api", "infer", "--concurrency", "1,3", "--requests", "12",
                 "--max-tokens", "5", "--seed", "11", "--slo-ttft-ms", "1000", "--slo-tpot-ms", "1000",
                 "--out", str(out), "--plot", str(plot), "--no-progress", "--timeout", "10"])
    assert code == 0
    refused = sum(1 for item in Workload(seed=11).items(12) if item.seed % 4 == 0)
    assert 0 < refused < 12  # the seed makes both outcomes happen

    document = json.loads(out.read_text())
    points = document["targets"]["target"]
    assert [p["label"] for p in points] == ["c=1", "c=3"]
    for p in points:
        s = p["summary"]
        assert s["requests"] == 12
        assert s["errors"] == {"http 503 kv_full": refused}
        assert s["successes"] == 12 - refused
        assert s["output_tokens"] == 5 * (12 - refused)
        assert s["token_mismatches"] == 0
        assert s["ttft_ms"]["p50"] >= TOKEN_DELAY * 1e3
        assert s["itl_ms"]["count"] == 4 * (12 - refused)
        assert s["goodput_rps"] == pytest.approx(s["requests_per_s"])
        assert s["slo_attainment"] == pytest.approx((12 - refused) / 12)
    assert document["config"]["concurrency"] == "1,3"
    assert state["peak"] <= 3  # the closed loop never has more than 3 requests in flight

    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    printed = capsys.readouterr().out
    assert "c=3: 12 requests" in printed and "errors: http 503 kv_full" in printed
    assert "TTFT p50" in printed  # the sweep table
