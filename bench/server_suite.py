"""llama.cpp's own server test suite, pointed at the pool and at llama-server, both serving the default model:
which tests each passes, and the ones the pool fails that llama-server passes (issue 36).

Owns: running the suite (tools/server/tests from the llama.cpp sources the pinned llama-cpp-python sdist
vendors: bench/llama_server.py fetches them) once against each target with its `DEBUG_EXTERNAL` mode (one
running server, the suite starting none), in a virtual environment of its own with the suite's
requirements (`--venv`, made on first use); reading each run's JUnit report; printing the comparison
and writing it as JSON (`--out`). Both targets run the default model (SmolLM2-135M, not the suite's own
tiny models, which come from a model hub this machine does not reach): the tests that check one model's
text fail on both, and the comparison is what matters. Must not: change the suite or either server.

    .venv/bin/python -m bench.server_suite [--files unit/test_chat_completion.py,...] [--out FILE]

The targets: llama-server (built from the same sources, `-np 2`, 2,048 tokens a slot, `--jinja`,
`--metrics`, `--slots`) and the pool (one coordinator with `--any-model-name true`, one worker with 2
sequences of 2,048 tokens),
each on 127.0.0.1, each stopped when its run ends.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path

from bench.llama_server import Build, LlamaServer, sources
from bench.processes import pool
from worker.provision import DEFAULT_MODEL_PATH

FILES = ("unit/test_basic.py", "unit/test_chat_completion.py", "unit/test_completion.py", "unit/test_tokenize.py",
         "unit/test_stream.py", "unit/test_ignore_eos.py", "unit/test_tool_call.py",
         "unit/test_compat_oai_responses.py", "unit/test_compat_anthropic.py", "unit/test_embedding.py",
         "unit/test_metrics.py")
RUN_TIMEOUT = 1800  # seconds for one target's run
THREADS = 2


def suite_dir(build: Build) -> Path:
    return sources(build) / "tools" / "server" / "tests"


def ensure_venv(venv: Path, tests: Path) -> Path:
    """The suite's Python, with its own requirements.txt installed once."""
    python = venv / "bin" / "python"
    stamp = venv / ".suite-requirements"
    wanted = (tests / "requirements.txt").read_text()
    if not python.exists() or not stamp.exists() or stamp.read_text() != wanted:
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(python), "-m", "pip", "install", "--quiet", "-r", str(tests / "requirements.txt")],
                       check=True)
        stamp.write_text(wanted)
    return python


def run_suite(python: Path, tests: Path, port: int, files: Sequence[str], report: Path) -> None:
    """The suite against the server on `port`, its JUnit report written to `report`."""
    env = {**os.environ, "DEBUG_EXTERNAL": "1", "PORT": str(port), "LLAMA_CACHE": str(report.parent / "cache")}
    subprocess.run([str(python), "-m", "pytest", *files, "-q", "-p", "no:cacheprovider", f"--junitxml={report}"],
                   cwd=tests, env=env, timeout=RUN_TIMEOUT, check=False, stdout=subprocess.DEVNULL)


def outcomes(report: Path) -> dict[str, str]:
    found: dict[str, str] = {}
    for case in ET.parse(report).iter("testcase"):
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        kinds = {child.tag for child in case}
        found[name] = next((k for k in ("error", "failure", "skipped") if k in kinds), "passed").replace(
            "failure", "failed")
    return found


def compare(peer: Mapping[str, str], ours: Mapping[str, str]) -> dict[str, list[str]]:
    """The tests by what each target did: both passed, both failed, only the pool failed, only the peer."""
    split: dict[str, list[str]] = {"both_passed": [], "both_failed": [], "pool_failed_only": [],
                                   "peer_failed_only": [], "skipped": []}
    for name in sorted(set(peer) | set(ours)):
        a, b = peer.get(name, "missing"), ours.get(name, "missing")
        if "skipped" in (a, b):
            split["skipped"].append(name)
        elif a == b == "passed":
            split["both_passed"].append(name)
        elif a == "passed":
            split["pool_failed_only"].append(name)
        elif b == "passed":
            split["peer_failed_only"].append(name)
        else:
            split["both_failed"].append(name)
    return split


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", default=",".join(FILES), help="the suite's test files, comma-separated")
    parser.add_argument("--venv", type=Path, default=Path(tempfile.gettempdir()) / "llama-server-suite-venv")
    parser.add_argument("--out", type=Path, help="write the comparison as JSON here")
    parser.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "llama-server-suite",
                        help="the runs' reports and logs (peer.xml, pool.xml)")
    parser.add_argument("--targets", default="peer,pool",
                        help="which to run now (comma-separated); a target not run is read from its report in --work")
    args = parser.parse_args(argv)
    files = [f for f in args.files.split(",") if f]
    build = Build.default()
    tests = suite_dir(build)
    python = ensure_venv(args.venv, tests)
    work = args.work
    (work / "pool").mkdir(parents=True, exist_ok=True)
    targets = set(args.targets.split(","))
    if "peer" in targets:
        with LlamaServer(DEFAULT_MODEL_PATH, threads=THREADS, slots=2, n_ctx=2048, log_path=work / "llama-server.log",
                         extra_args=["--jinja", "--metrics", "--slots"]) as peer:
            run_suite(python, tests, peer.port, files, work / "peer.xml")
    if "pool" in targets:
        worker = ["--threads", str(THREADS), "--max-sessions", "2", "--session-max-tokens", "2048"]
        # The suite names models of its own (a hub's, `gpt-3.5-turbo-instruct`): llama-server serves its one
        # model under any name, and so does a pool set to (ANY_MODEL_NAME).
        with pool(work / "pool", workers=[worker], coordinator=["--any-model-name", "true"]) as running:
            run_suite(python, tests, int(running.url.rsplit(":", 1)[1]), files, work / "pool.xml")
    missing = [str(report) for report in (work / "peer.xml", work / "pool.xml") if not report.exists()]
    if missing:  # a target run alone: its report is kept for a later `--targets` of the other
        print(f"no report at {', '.join(missing)}: run that target (--targets) with this --work", file=sys.stderr)
        return 1
    peer_results, pool_results = outcomes(work / "peer.xml"), outcomes(work / "pool.xml")
    split = compare(peer_results, pool_results)
    print(f"llama.cpp {build.version} server suite, {len(files)} files: llama-server "
          f"{dict(Counter(peer_results.values()))}; pool {dict(Counter(pool_results.values()))}")
    for key, names in split.items():
        print(f"{key}: {len(names)}")
    for name in split["pool_failed_only"]:
        print(f"  pool failed, llama-server passed: {name}")
    if args.out is not None:
        args.out.write_text(json.dumps({"version": build.version, "files": files, **split}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
