"""Session reuse: time to first token of a follow-up turn, with and without the session's KV.

Starts one real worker on loopback and, per repetition:
  1. turn 1 (raw prompt of about `--prompt-tokens` tokens) in a new session;
  2. turn 2 in that session: only the new text is prefilled;
  3. the same tokens as turn 2 sees (turn-1 prompt + turn-1 output + turn-2 text) as a fresh one-shot
     request: everything is prefilled.
Prints the medians of the worker-side TTFT (from the `done` event) and their ratio.

    .venv/bin/python -m bench.session_bench [--prompt-tokens 1000] [--repeat 5] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import httpx

from bench.processes import peer_env, serving
from worker.provision import DEFAULT_MODEL_PATH

FILLER = ("The lighthouse keeper wrote in his log every night: the wind, the ships, the colour of the sea, "
          "and the names of the gulls he had come to know. ")


def stream(client: httpx.Client, url: str, payload: dict) -> tuple[str, dict]:
    text, done = [], {}
    with client.stream("POST", url + "/worker/generate", json=payload) as response:
        response.raise_for_status()
        event = ""
        for line in response.iter_lines():
            if line.startswith("event:"):
                event = line[6:].strip()
            elif line.startswith("data:"):
                data = json.loads(line[5:])
                if event == "token":
                    text.append(data["token"])
                elif event == "done":
                    done = data
                elif event == "error":
                    raise RuntimeError(data)
    return "".join(text), done


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt-tokens", type=int, default=1000)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--port", type=int, default=3051)
    args = parser.parse_args(argv)
    url = f"http://127.0.0.1:{args.port}"
    argv = [sys.executable, "-m", "worker", "--port", str(args.port), "--coordinator-url", "",
            "--threads", str(args.threads), "--max-sessions", "4", "--session-max-tokens", "4096",
            "--log-level", "warning", "--model-path", str(DEFAULT_MODEL_PATH),
            # The fresh request repeats every repetition: the prompt cache would serve it from the last
            # one's cells and hide the cost this benchmark compares against.
            "--no-prompt-cache"]
    # No worker token: generate and DELETE /worker/sessions then need none.
    with serving("worker", argv, url + "/worker/health", timeout=60, env=peer_env(None)):
        # about 28 tokens per filler sentence
        first_prompt = FILLER * max(1, args.prompt_tokens // 28)
        follow_up = " The next morning he wrote:"
        reused, fresh, prompt_sizes = [], [], []
        with httpx.Client(timeout=120) as client:
            for i in range(args.repeat):
                session = f"bench-{i}"
                common = {"raw": True, "temperature": 0, "max_tokens": 16}
                out1, done1 = stream(client, url, {**common, "prompt": first_prompt, "session_id": session})
                _, done2 = stream(client, url, {**common, "prompt": follow_up, "session_id": session})
                _, done3 = stream(client, url, {**common, "prompt": first_prompt + out1 + follow_up})
                client.delete(f"{url}/worker/sessions/{session}").raise_for_status()
                reused.append(done2["timings"]["ttft_ms"])
                fresh.append(done3["timings"]["ttft_ms"])
                prompt_sizes.append((done1["usage"]["prompt_tokens"], done2["usage"]["prompt_tokens"],
                                     done2["usage"]["cached_tokens"],
                                     done3["usage"]["prompt_tokens"] - done3["usage"]["cached_tokens"]))
        t1, t2, cached, t3 = prompt_sizes[-1]
        print(f"threads={args.threads}  turn-1 prompt {t1} tokens; turn 2 sees {t2} tokens, {cached} cached; "
              f"fresh request prefills {t3}")
        print(f"TTFT turn 2 with session  : median {statistics.median(reused):8.1f} ms  {sorted(reused)}")
        print(f"TTFT same tokens, no reuse: median {statistics.median(fresh):8.1f} ms  {sorted(fresh)}")
        print(f"ratio fresh / reused      : {statistics.median(fresh) / statistics.median(reused):.1f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
