#!/usr/bin/env python3
"""Stream one prompt through the coordinator and print the tokens as they arrive, then timings.

    python3 test_inference.py "Tell me a joke" [max_tokens]
    python3 test_inference.py --url http://127.0.0.1:1337 --session-id chat-1 "And another" 64

Uses only the standard library, so any Python 3.11 runs it. Exit status: 0 when the stream ends
with a `done` event; 1 when the coordinator refuses (the JSON error body is printed) or the stream
ends with an `error` event or without `done`; 2 when the coordinator cannot be reached.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import sys
import time
import urllib.parse
from collections.abc import Iterator


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("prompt")
    parser.add_argument("max_tokens", nargs="?", type=int, default=128)
    parser.add_argument("--url", default=os.environ.get("COORDINATOR_URL", "http://127.0.0.1:1337"))
    parser.add_argument("--temperature", type=float)
    parser.add_argument("--seed", type=int)
    parser.add_argument("--session-id")
    parser.add_argument("--model")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds of silence before giving up")
    return parser.parse_args(argv)


def sse_events(response: http.client.HTTPResponse) -> Iterator[tuple[str, str]]:
    name, data = "message", list[str]()
    for raw in response:
        line = raw.decode("utf-8").rstrip("\r\n")
        if not line:
            if data:
                yield name, "\n".join(data)
            name, data = "message", []
        elif line.startswith(":"):
            continue
        elif line.startswith("event:"):
            name = line[6:].strip()
        elif line.startswith("data:"):
            data.append(line[5:].removeprefix(" "))


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    body: dict[str, object] = {"prompt": args.prompt, "max_tokens": args.max_tokens}
    for key in ("temperature", "seed", "session_id", "model"):
        if getattr(args, key) is not None:
            body[key] = getattr(args, key)
    url = urllib.parse.urlsplit(args.url)
    conn_type = http.client.HTTPSConnection if url.scheme == "https" else http.client.HTTPConnection
    conn = conn_type(url.hostname or "127.0.0.1", url.port, timeout=args.timeout)
    started = time.perf_counter()
    try:
        conn.request("POST", url.path.rstrip("/") + "/coordinator/infer", body=json.dumps(body),
                     headers={"content-type": "application/json", "accept": "text/event-stream"})
        response = conn.getresponse()
    except OSError as exc:
        print(f"error: cannot reach the coordinator at {args.url}: {exc}", file=sys.stderr)
        return 2
    if response.status != 200:
        print(f"error: HTTP {response.status}", file=sys.stderr)
        print(response.read().decode("utf-8", "replace"), file=sys.stderr)
        return 1
    first = last = None
    tokens = 0
    try:
        for name, data in sse_events(response):
            event = json.loads(data)
            if name == "token":
                last = time.perf_counter()
                first = first or last
                tokens += 1
                sys.stdout.write(event["token"])
                sys.stdout.flush()
            elif name == "done":
                print()
                report(event, started, first, last, tokens, response.getheader("x-request-id", ""))
                return 0
            elif name == "error":
                print(f"\nerror: {json.dumps(event)}", file=sys.stderr)
                return 1
    except (OSError, http.client.HTTPException) as exc:
        print(f"\nerror: the stream broke: {exc}", file=sys.stderr)
        return 1
    print("\nerror: the stream ended without a done event", file=sys.stderr)
    return 1


def report(done: dict, started: float, first: float | None, last: float | None, tokens: int,  # type: ignore[type-arg]
           request_id: str) -> None:
    ttft = (first - started) * 1000 if first else float("nan")
    rate = (tokens - 1) / (last - first) if first and last and last > first else float("nan")
    usage = done.get("usage", {})
    print(f"TTFT {ttft:.1f} ms | {rate:.1f} tokens/s | {tokens} tokens | worker {done.get('worker_id')} | "
          f"finish {done.get('finish_reason')} | prompt {usage.get('prompt_tokens')} tokens | "
          f"request {request_id}")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
