"""`python -m bench.load`: builds the clients and runners the flags ask for, runs, reports.

Owns: the order of a run (warm-up, points, tables, JSON, plot) and, in comparison mode, the peer
server's lifetime around it (stopped in a `finally`, whatever happens).
Must not: parse flags (cli.py), define metrics (stats.py) or format numbers (report.py).
"""

from __future__ import annotations

import os
import platform
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
import uvloop

from bench.load import compare, report
from bench.load.cli import Options, UsageError, build_parser, validate
from bench.load.clients import Sampling, make_client
from bench.load.peer import make_peer
from bench.load.plot import plot_sweep
from bench.load.runner import PointResult, Runner
from bench.load.stats import Slo
from bench.load.workload import Workload
from bench.worker_token import auth_headers


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        options = validate(args, os.environ)
    except UsageError as exc:
        parser.error(str(exc))
    if options.peer is not None:
        return run_comparison(options, options.peer)
    return run_single(options)


def sampling_of(options: Options, *, raw: bool, banned: tuple[int, ...] = (), model: str | None = None) -> Sampling:
    a = options.args
    return Sampling(max_tokens=a.max_tokens, temperature=a.temperature, top_p=a.top_p, top_k=a.top_k,
                    ignore_eos=a.ignore_eos, raw=raw, banned_tokens=banned, model=model)


def runner_for(options: Options, api: str, url: str, sampling: Sampling, prompts: Sequence[str]) -> Runner:
    a = options.args
    headers = auth_headers(options.worker_token) if api == "worker" else {}
    client = make_client(api, url, sampling, timeout=a.timeout, headers=headers)
    return Runner(client, Workload(prompts, seed=a.seed), slo=Slo(a.slo_ttft_ms, a.slo_tpot_ms),
                  cap=a.request_cap, failure_pause=a.failure_pause_ms / 1e3, progress=not a.no_progress)


def openai_model(url: str) -> str | None:
    """The first model a server lists, for OpenAI servers that require `model` (vLLM does)."""
    try:
        data = httpx.get(url.rstrip("/") + "/v1/models", timeout=5, trust_env=False).json()
        return str(data["data"][0]["id"])
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError):
        return None


def print_point(target: str = "") -> Any:
    def show(*parts: Any) -> None:
        name, result = parts if len(parts) == 2 else (target, parts[0])
        print(report.point_block(result, name), flush=True)
    return show


def run_single(options: Options) -> int:
    a = options.args
    banned = options.banned_tokens
    if a.api == "openai" and a.ignore_eos and not banned:
        banned = compare.prepare_prompts(a.model_path, (), chat_template=False).eog_tokens
    model = a.model or (openai_model(a.url) if a.api == "openai" else None)
    runner = runner_for(options, a.api, a.url, sampling_of(options, raw=a.raw, banned=banned, model=model),
                        options.prompts)
    print(header(options, a.api, a.url))
    results = uvloop.run(_sweep(runner, options, print_point()))
    print()
    print(report.sweep_table(results))
    finish(options, {"target": results})
    return 0 if any(r.summary.successes for r in results) else 1


async def _sweep(runner: Runner, options: Options, show: Any) -> list[PointResult]:
    if options.args.warmup:
        await runner.warm_up(options.args.warmup)
    return await runner.sweep(options.points, on_point=show)


def run_comparison(options: Options, name: str) -> int:
    """`name`: the peer, "llama_cpp.server" or "llama-server"."""
    a = options.args
    prepared = compare.prepare_prompts(a.model_path, options.prompts, chat_template=not a.no_chat_template)
    banned = options.banned_tokens or (prepared.eog_tokens if a.ignore_eos else ())
    ours = runner_for(options, a.api, a.url,
                      sampling_of(options, raw=a.raw or not a.no_chat_template, model=a.model), prepared.prompts)
    peer = make_peer(name, a.model_path, threads=a.threads, port=a.peer_port, n_ctx=a.peer_ctx, slots=a.peer_slots,
                     cache=a.llama_server_cache)
    print(f"starting {name} on {peer.url} (threads {a.threads}, log {peer.log_path}) ...", flush=True)
    try:
        peer.start()
        theirs = runner_for(options, "openai", peer.url, sampling_of(options, raw=True, banned=banned),
                            prepared.prompts)
        print(header(options, a.api, a.url) + f"\npeer: {name} {peer.url} (openai api), "
              f"banned tokens {list(banned)}")
        mine, peers = uvloop.run(_compare(ours, theirs, options, name))
    finally:
        peer.stop()
    print()
    print("ours:\n" + report.sweep_table(mine))
    print(f"\n{name}:\n" + report.sweep_table(peers))
    rows = compare.ratios(mine, peers)
    print("\n" + compare.ratio_table(rows, name))
    finish(options, {"ours": mine, name: peers}, extra={"ratios": [r.as_json() for r in rows]})
    return 0 if any(r.summary.successes for r in mine) else 1


async def _compare(ours: Runner, theirs: Runner, options: Options,
                   name: str) -> tuple[list[PointResult], list[PointResult]]:
    if options.args.warmup:
        await ours.warm_up(options.args.warmup)
        await theirs.warm_up(options.args.warmup)
    return await compare.run_both(ours, theirs, options.points, on_point=print_point(), peer=name)


def header(options: Options, api: str, url: str) -> str:
    a, p = options.args, options.points[0]
    sweep = ",".join(f"{pt.level:g}" for pt in options.points)
    bound = " and ".join(x for x in (f"{p.requests} requests" if p.requests else "",
                                     f"{p.duration:g} s" if p.duration else "") if x)
    return (f"target {url} (api {api}); {p.mode} loop, "
            f"{'users' if p.mode == 'closed' else 'requests/s'} {sweep}; each point: {bound}; "
            f"max_tokens {a.max_tokens}{' ignore_eos' if a.ignore_eos else ''}, temperature {a.temperature:g}, "
            f"seed {a.seed}, {len(options.prompts)} prompts")


def finish(options: Options, targets: dict[str, list[PointResult]], extra: dict[str, Any] | None = None) -> None:
    a = options.args
    if a.out is not None:
        config = {k: (str(v) if isinstance(v, Path) else v)
                  for k, v in vars(a).items() if k != "worker_token"}  # a secret stays out of results
        config["machine"] = {"cpus": os.cpu_count(), "platform": platform.platform(),
                             "python": sys.version.split()[0]}
        report.write_json(a.out, config, targets, extra)
        print(f"wrote {a.out}")
    if a.plot is not None and any(targets.values()):
        plot_sweep(targets, a.plot, title=f"{a.url} ({a.api}), max_tokens {a.max_tokens}")
        print(f"wrote {a.plot}")
