"""The OpenAI surface's cost: `/v1/chat/completions` against `/coordinator/infer` through the same stack.

Starts one real coordinator and one real worker on loopback, then, per repeat and in alternating
order (so drift in a shared machine hits both), runs the project's load tool (`bench.load`) against
each surface with the same prompts and sampling:
  - 16 closed-loop streams for `--duration` seconds: tokens/s relayed;
  - 1 stream, `--requests` requests one after another: TTFT p50 (client side, first content).
Prints each repeat's ratio (openai-chat / infer) and the median ratio. The target is at most 3%
overhead: tokens/s ratio >= 0.97 and TTFT ratio <= 1.03. First it times, in-process, what each surface
costs the coordinator per request (parsing) and per token (encoding); `--micro-only` stops there.

    .venv/bin/python -m bench.surface_bench [--repeat 3] [--duration 20] [--requests 30] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
import timeit
from pathlib import Path

import httpx

from bench.load.report import read_json
from bench.processes import free_port, serving
from coordinator.generation import Generation
from coordinator.relay.response import passthrough
from coordinator.surfaces import infer as infer_surface
from coordinator.surfaces import openai as openai_surface
from coordinator.surfaces.openai_format import ChunkEncoder, Options
from protocol.sse import SseEvent
from worker.provision import DEFAULT_MODEL_PATH

APIS = ("infer", "openai-chat")
CHAT = json.dumps({"messages": [{"role": "user", "content": "Write a haiku about the sea and the sky"}],
                   "max_tokens": 64, "temperature": 0.7, "top_k": 40, "seed": 3, "stream": True,
                   "stream_options": {"include_usage": True}}).encode()
INFER = json.dumps({"prompt": "Write a haiku about the sea and the sky", "max_tokens": 64, "temperature": 0.7,
                    "top_k": 40, "seed": 3}).encode()
TOKEN = SseEvent("token", '{"token":" sea","index":3,"probability":0.41,"finished":false}')


def micro(n: int = 20_000) -> None:
    """The coordinator's own per-request and per-token cost of each surface, in-process (no servers)."""
    encoder = ChunkEncoder(Options("chat", True, True), request_id="r", created=1, model="m")

    def chat() -> object:
        fields, _ = openai_surface._parse_chat(CHAT)
        return Generation.of(openai_surface.internal(fields), "r", "openai-chat")

    timings = {
        "parse /coordinator/infer": timeit.timeit(lambda: infer_surface.parse(INFER, "r"), number=n),
        "parse /v1/chat/completions": timeit.timeit(chat, number=n),
        "token event, passed through": timeit.timeit(lambda: passthrough(TOKEN), number=n),
        "token event as a chat.completion.chunk": timeit.timeit(lambda: encoder(TOKEN), number=n),
    }
    for what, seconds in timings.items():
        print(f"{what:>40}: {seconds / n * 1e6:6.2f} us")


def load(url: str, api: str, out: Path, *points: str) -> tuple[float, float | None]:
    """One bench.load run: (tokens/s, TTFT p50 ms) of its one point."""
    subprocess.run([sys.executable, "-m", "bench.load", "--url", url, "--api", api, "--max-tokens", "64",
                    "--ignore-eos", "--temperature", "0.7", "--seed", "1", "--warmup", "2", "--no-progress",
                    "--out", str(out), *points], check=True, stdout=subprocess.DEVNULL)
    summary = read_json(out)[next(iter(read_json(out)))][0].summary
    if summary.failures:
        raise RuntimeError(f"{api}: {summary.failures} failed requests: {summary.errors}")
    return summary.tokens_per_s, summary.ttft_ms.p50


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--duration", type=float, default=20.0, help="seconds of the 16-stream point")
    parser.add_argument("--requests", type=int, default=30, help="requests of the 1-stream point")
    parser.add_argument("--threads", type=int, default=1, help="llama.cpp threads of the worker")
    parser.add_argument("--micro-only", action="store_true", help="only the in-process cost of each surface")
    args = parser.parse_args(argv)
    micro()
    if args.micro_only:
        return 0
    port, wport = free_port(), free_port()
    url = f"http://127.0.0.1:{port}"
    print(f"coordinator + 1 worker ({args.threads} llama.cpp thread(s), 16 sessions), max_tokens 64, "
          f"load tool in its own process; {args.repeat} repeats")
    with tempfile.TemporaryDirectory(prefix="surface-bench-") as tmp:
        out = Path(tmp)
        with serving("coordinator", [sys.executable, "-m", "coordinator", "--port", str(port),
                                     "--heartbeat-interval", "1", "--log-level", "warning"],
                     url + "/coordinator/health", log_path=out / "coordinator.log"), \
             serving("worker", [sys.executable, "-m", "worker", "--port", str(wport), "--coordinator-url", url,
                                "--threads", str(args.threads), "--heartbeat-interval", "0.5",
                                "--log-level", "warning", "--model-path", str(DEFAULT_MODEL_PATH)],
                     f"http://127.0.0.1:{wport}/worker/health", log_path=out / "worker.log"):
            deadline = time.monotonic() + 30
            while httpx.get(url + "/coordinator/health", timeout=2).json()["workers"]["alive"] < 1:
                if time.monotonic() > deadline:
                    raise RuntimeError("the worker did not register")
                time.sleep(0.2)
            tps_ratios, ttft_ratios = [], []
            for rep in range(args.repeat):
                tps: dict[str, float] = {}
                ttft: dict[str, float] = {}
                for api in APIS if rep % 2 == 0 else APIS[::-1]:
                    tps[api], _ = load(url, api, out / f"{api}-16.json", "--concurrency", "16",
                                       "--duration", str(args.duration))
                    _, first = load(url, api, out / f"{api}-1.json", "--concurrency", "1",
                                    "--requests", str(args.requests))
                    assert first is not None
                    ttft[api] = first
                tps_ratios.append(tps["openai-chat"] / tps["infer"])
                ttft_ratios.append(ttft["openai-chat"] / ttft["infer"])
                print(f"repeat {rep + 1}: 16 streams tokens/s infer {tps['infer']:.1f}, openai-chat "
                      f"{tps['openai-chat']:.1f} (ratio {tps_ratios[-1]:.3f}); 1 stream TTFT p50 infer "
                      f"{ttft['infer']:.1f} ms, openai-chat {ttft['openai-chat']:.1f} ms (ratio {ttft_ratios[-1]:.3f})")
    tps_m, ttft_m = statistics.median(tps_ratios), statistics.median(ttft_ratios)
    print(f"median tokens/s ratio (openai-chat / infer): {tps_m:.3f}  target >= 0.97: "
          f"{'MET' if tps_m >= 0.97 else 'MISSED'}")
    print(f"median TTFT p50 ratio (openai-chat / infer): {ttft_m:.3f}  target <= 1.03: "
          f"{'MET' if ttft_m <= 1.03 else 'MISSED'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
