"""Flags of `python -m bench.load`, validated once into an `Options`, every problem reported at once.

Owns: flag names, defaults, the loopback-only rule for targets, and turning sweeps into `Point`s.
Must not: send requests or print results (command.py does).
"""

from __future__ import annotations

import argparse
import ipaddress
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from bench.load.runner import Point
from bench.load.workload import PROMPTS
from bench.worker_token import find_token

LOOPBACK_NAMES = {"localhost"}
DEFAULT_DURATION_S = 10.0
APIS = ("infer", "worker", "openai", "openai-chat")


class UsageError(ValueError):
    """Flags that cannot make a run; the message lists every problem."""


def check_loopback(url: str) -> str | None:
    """The problem with `url` as a target, or None: only 127.0.0.1, ::1 and localhost are allowed here."""
    try:
        parts = urlsplit(url)
        host = parts.hostname or ""
        parts.port  # noqa: B018 - raises on a bad port
    except ValueError as exc:
        return f"--url {url!r} is not a URL: {exc}"
    if parts.scheme not in ("http", "https"):
        return f"--url {url!r} must start with http:// or https://"
    if host.lower() in LOOPBACK_NAMES:
        return None
    try:
        if ipaddress.ip_address(host) in (ipaddress.ip_address("127.0.0.1"), ipaddress.ip_address("::1")):
            return None
    except ValueError:
        pass
    return (f"--url {url!r}: only loopback targets are allowed (127.0.0.1, localhost, ::1); "
            f"host {host!r} is not one")


def parse_list(text: str, kind: type[int | float], flag: str) -> list[float]:
    try:
        values = [float(kind(v)) for v in text.split(",") if v.strip()]
    except ValueError:
        raise UsageError(f"{flag} {text!r}: expected a comma-separated list of numbers") from None
    if not values or any(v <= 0 for v in values):
        raise UsageError(f"{flag} {text!r}: every value must be positive")
    return values


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.load", description=(
        "Load-test a streaming LLM endpoint (this project's SSE API, or OpenAI's /v1/completions or "
        "/v1/chat/completions): "
        "TTFT, TPOT, ITL, e2e percentiles, throughput and goodput per concurrency or arrival rate."))
    t = p.add_argument_group("target")
    t.add_argument("--url", required=True, help="base URL, loopback only, e.g. http://127.0.0.1:1337")
    t.add_argument("--api", choices=APIS, default="infer",
                   help="infer: POST /coordinator/infer; worker: POST /worker/generate; "
                        "openai: POST /v1/completions (stream); openai-chat: POST /v1/chat/completions "
                        "(stream, the prompt as one user message, usage requested; top_k, and ignore_eos "
                        "when set, go as extra fields), e.g. to compare with --api infer on one coordinator")
    t.add_argument("--model", help="model name to send (openai: default the first of GET /v1/models; "
                                   "infer, worker, openai-chat: sent only if given)")
    t.add_argument("--timeout", type=float, default=120.0, help="per-request deadline, seconds")
    t.add_argument("--worker-token", help="worker: the pool's worker token, sent as a bearer token (default: "
                                          "$WORKER_TOKEN, else $LOG_DIR/worker-token as ./start.sh writes it)")
    w = p.add_argument_group("workload")
    w.add_argument("--mode", choices=("closed", "open"),
                   help="closed: N users back to back; open: Poisson arrivals (default: open if --rate)")
    w.add_argument("--concurrency", default="1", help="closed loop: users per point, e.g. 1,8,16")
    w.add_argument("--rate", help="open loop: requests/s per point, e.g. 2,4,8")
    w.add_argument("--requests", type=int, help="requests per point")
    w.add_argument("--duration", type=float,
                   help=f"seconds per point (default {DEFAULT_DURATION_S:g} if --requests is not given)")
    w.add_argument("--request-cap", type=int, default=10_000, help="hard cap on requests over the whole run")
    w.add_argument("--failure-pause-ms", type=float, default=50.0,
                   help="closed loop: a user waits this long after a failed request (0: retry at once)")
    w.add_argument("--warmup", type=int, default=0, help="unmeasured requests sent first, one at a time")
    w.add_argument("--prompt", action="append", help="a prompt (repeat for several; default: 8 built-in)")
    w.add_argument("--seed", type=int, default=0, help="seeds prompt order, arrivals and sampling seeds")
    s = p.add_argument_group("sampling")
    s.add_argument("--max-tokens", type=int, default=64)
    s.add_argument("--temperature", type=float, default=0.8)
    s.add_argument("--top-p", type=float, default=0.95)
    s.add_argument("--top-k", type=int, default=40)
    s.add_argument("--ignore-eos", action="store_true",
                   help="generate max-tokens every time (openai-chat: sends our ignore_eos extension)")
    s.add_argument("--logit-bias-ban", help="openai, openai-chat: token ids sent as logit_bias -100 "
                                             "(openai's stand-in for --ignore-eos), e.g. 0,2; openai's default with "
                                             "--model-path: the model's end tokens")
    s.add_argument("--raw", action="store_true",
                   help="infer, worker: send raw=true (no chat template); not with openai-chat")
    o = p.add_argument_group("output")
    o.add_argument("--out", type=Path, help="write every point's summary as JSON here")
    o.add_argument("--plot", type=Path, help="write a PNG: throughput and latency against the sweep")
    o.add_argument("--slo-ttft-ms", type=float, help="goodput: TTFT at most this")
    o.add_argument("--slo-tpot-ms", type=float, help="goodput: TPOT at most this")
    o.add_argument("--no-progress", action="store_true", help="no progress bar")
    c = p.add_argument_group("comparison with llama_cpp.server or llama-server")
    c.add_argument("--compare-llama-cpp-server", action="store_true",
                   help="also start `python -m llama_cpp.server` and run the same points against it")
    c.add_argument("--compare-llama-server", action="store_true",
                   help="also start llama.cpp's own `llama-server` (built once from the pinned llama-cpp-python "
                        "sdist: python -m bench.llama_server --build) and run the same points against it")
    c.add_argument("--model-path", type=Path, help="GGUF the peer serves (the same one as ours)")
    c.add_argument("--threads", type=int, help="peer threads (start ours with the same --threads)")
    c.add_argument("--peer-port", type=int, help="default: a free port")
    c.add_argument("--peer-ctx", type=int, default=2048,
                   help="peer n_ctx (llama-server: each slot's; it is started with -c peer-ctx x peer-slots)")
    c.add_argument("--peer-slots", type=int,
                   help="llama-server: parallel sequences (-np; default 16, the worker's default --max-sessions)")
    c.add_argument("--llama-server-cache", type=Path,
                   help="llama-server's build cache root (default $LLAMA_SERVER_CACHE, "
                        "else ~/.cache/llm-pool/llama-server)")
    c.add_argument("--no-chat-template", action="store_true",
                   help="send the prompts as raw text to both, instead of the model's chat template")
    return p


def comparison_flag(args: argparse.Namespace) -> str | None:
    """The comparison flag given (the first, if both are), or None."""
    if args.compare_llama_cpp_server:
        return "--compare-llama-cpp-server"
    if args.compare_llama_server:
        return "--compare-llama-server"
    return None


@dataclass(frozen=True)
class Options:
    args: argparse.Namespace
    points: list[Point]
    banned_tokens: tuple[int, ...]
    prompts: tuple[str, ...]
    worker_token: str | None = None  # --api worker: sent with every request; never written out

    @property
    def peer(self) -> str | None:
        """The peer server a comparison runs against ("llama_cpp.server" or "llama-server"), or None."""
        if self.args.compare_llama_cpp_server:
            return "llama_cpp.server"
        if self.args.compare_llama_server:
            return "llama-server"
        return None


def validate(args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> Options:
    """`environ` (the process's, from the command) is where --api worker looks for the worker token when
    no flag gives it."""
    problems: list[str] = []
    if (problem := check_loopback(args.url)) is not None:
        problems.append(problem)
    mode = args.mode or ("open" if args.rate else "closed")
    levels: list[float] = []
    try:
        if mode == "open":
            if not args.rate:
                raise UsageError("--mode open needs --rate, e.g. --rate 2,4,8")
            levels = parse_list(args.rate, float, "--rate")
        else:
            if args.rate:
                raise UsageError("--rate is for --mode open; use --concurrency for a closed loop")
            levels = parse_list(args.concurrency, int, "--concurrency")
    except UsageError as exc:
        problems.append(str(exc))
    for flag, value in (("--requests", args.requests), ("--duration", args.duration),
                        ("--timeout", args.timeout), ("--max-tokens", args.max_tokens),
                        ("--request-cap", args.request_cap)):
        if value is not None and value <= 0:
            problems.append(f"{flag} must be positive")
    if args.warmup < 0 or args.failure_pause_ms < 0:
        problems.append("--warmup and --failure-pause-ms must be 0 or more")
    banned: tuple[int, ...] = ()
    if args.logit_bias_ban:
        try:
            banned = tuple(int(v) for v in args.logit_bias_ban.split(",") if v.strip())
        except ValueError:
            problems.append(f"--logit-bias-ban {args.logit_bias_ban!r}: expected token ids like 0,2")
    if args.worker_token and args.api != "worker":
        problems.append("--worker-token is for --api worker: only a worker checks it")
    if args.api == "openai-chat" and args.raw:
        problems.append("--raw is not for --api openai-chat: chat messages always get the chat template")
    peer_flag = comparison_flag(args)
    if args.compare_llama_cpp_server and args.compare_llama_server:
        problems.append("--compare-llama-cpp-server and --compare-llama-server: one peer per run")
    if not args.compare_llama_server:
        for name, value in (("--peer-slots", args.peer_slots), ("--llama-server-cache", args.llama_server_cache)):
            if value is not None:
                problems.append(f"{name} is for --compare-llama-server")
    elif args.peer_slots is not None and args.peer_slots < 1:
        problems.append("--peer-slots must be positive")
    if peer_flag is not None:
        if args.api in ("openai", "openai-chat"):
            problems.append(f"{peer_flag} measures ours: use --api infer or worker")
        if args.model_path is None or not args.model_path.is_file():
            problems.append(f"{peer_flag} needs --model-path to a GGUF file (got {args.model_path})")
        if args.threads is None or args.threads < 1:
            problems.append(f"{peer_flag} needs --threads (the same as ours)")
    elif args.api == "openai" and args.ignore_eos and not banned and args.model_path is None:
        problems.append("--ignore-eos with --api openai needs --logit-bias-ban IDS or --model-path "
                        "(OpenAI servers have no ignore_eos)")
    if problems:
        raise UsageError("\n".join(problems))
    duration = args.duration
    if args.requests is None and duration is None:
        duration = DEFAULT_DURATION_S
    points = [Point(mode, level, args.requests, duration) for level in levels]  # type: ignore[arg-type]
    token = find_token(args.worker_token, environ or {}) if args.api == "worker" else None
    return Options(args, points, banned, tuple(args.prompt) if args.prompt else PROMPTS, token)
