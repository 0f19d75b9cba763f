"""scripts/bootstrap.sh's progress while a slow step runs, driven by a fake build that prints CMake and
Ninja progress lines: the function under test is sourced from the script itself, so these are the
lines a first-time user sees while llama.cpp compiles (7 minutes there, 2 seconds here)."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

# runs scripts/bootstrap.sh in a shell
pytestmark = pytest.mark.process

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bootstrap.sh"

# A build that prints a step every 0.3 s the way pip -v shows scikit-build-core's CMake/Ninja output,
# then exits with the status it is given.
FAKE_BUILD = textwrap.dedent("""
    import sys, time
    print("Collecting llama-cpp-python==0.3.36", flush=True)
    for i in range(1, 8):
        time.sleep(0.3)
        print(f"  [{i}/193] /usr/bin/c++ -DGGML_BUILD -O3 -fPIC -o vendor/ggml/CMakeFiles/ggml-base.dir/ggml-{i}.c.o"
              f" -c /tmp/pip/vendor/ggml-{i}.c", flush=True)
    print("[ 42%] Building C object vendor/llama.cpp/ggml/src/CMakeFiles/ggml-cpu.dir/ggml-cpu.c.o", flush=True)
    time.sleep(0.6)
    print("error: the compiler ran out of patience" if sys.argv[1] != "0" else "Successfully installed", flush=True)
    sys.exit(int(sys.argv[1]))
""")


def _run(tmp_path: Path, status: int, interval: float = 0.5) -> subprocess.CompletedProcess[str]:
    fake = tmp_path / "fake_build.py"
    fake.write_text(FAKE_BUILD)
    log = tmp_path / "logs" / "build.log"
    command = (f'source "{SCRIPT}"; PROGRESS_INTERVAL={interval} PROGRESS_FAIL_LINES=3 '
               f'run_with_progress "building llama.cpp" "{log}" "{sys.executable}" "{fake}" {status}')
    return subprocess.run(["bash", "-c", command], check=False, capture_output=True, text=True, timeout=30)


def test_a_slow_build_shows_elapsed_time_and_the_builds_current_step(tmp_path: Path) -> None:
    done = _run(tmp_path, 0)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    log = tmp_path / "logs" / "build.log"
    assert lines[0] == f"bootstrap: building llama.cpp (full log: {log})"
    ticks = [line for line in lines if re.fullmatch(r"bootstrap: building llama\.cpp \dm\d\ds .*", line)]
    assert len(ticks) >= 3, done.stdout
    # Each tick names a step the build had printed: Ninja's counter with the object, later CMake's percentage.
    steps = [tick.split(" ", 4)[4] for tick in ticks]
    assert any(re.fullmatch(r"\[\d/193\] ggml-\d\.c\.o", step) for step in steps), steps
    assert steps[-1].startswith("[ 42%] Building C object"), steps
    assert lines[-1].startswith("bootstrap: building llama.cpp done in 0m0"), lines[-1]
    # The full output is in the log, compiler commands included.
    assert "-DGGML_BUILD" in log.read_text() and "Successfully installed" in log.read_text()


def test_a_failed_build_prints_the_logs_last_lines_and_its_status(tmp_path: Path) -> None:
    done = _run(tmp_path, 3)
    assert done.returncode == 3
    log = tmp_path / "logs" / "build.log"
    assert "bootstrap: building llama.cpp failed (exit 3) after 0m0" in done.stderr
    assert f"last lines of {log}:" in done.stderr
    shown = done.stderr.splitlines()[-3:]  # PROGRESS_FAIL_LINES=3
    assert shown[-1] == "    error: the compiler ran out of patience"
    assert shown[-2].startswith("    [ 42%] Building C object")


def test_a_quick_step_prints_nothing(tmp_path: Path) -> None:
    """The fast path (model already there) stays silent and quick."""
    log = tmp_path / "quick.log"
    command = f'source "{SCRIPT}"; PROGRESS_INTERVAL=5 run_with_progress "fetching the model" "{log}" true'
    done = subprocess.run(["bash", "-c", command], check=False, capture_output=True, text=True, timeout=10)
    assert done.returncode == 0 and done.stdout == "" and done.stderr == ""


def test_stopping_bootstrap_stops_the_build_and_what_it_started(tmp_path: Path) -> None:
    """Ctrl+C (or SIGTERM) during the build must not leave compilers running in the background."""
    pids = tmp_path / "pids"
    build = f'sleep 300 & echo $! > "{pids}"; echo "[1/193] compiling"; wait'
    command = (f'source "{SCRIPT}"; PROGRESS_INTERVAL=0.2 '
               f'run_with_progress "building" "{tmp_path / "build.log"}" bash -c \'{build}\'')
    shell = subprocess.Popen(["bash", "-c", command], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert shell.stdout is not None
        assert shell.stdout.readline().startswith("bootstrap: building (full log:")
        grandchild = int(pids.read_text())
        shell.terminate()
        _, err = shell.communicate(timeout=10)
        assert shell.returncode == 130 and "bootstrap: building interrupted" in err
        assert not _alive(grandchild), "the build's own child survived"
    finally:
        if shell.poll() is None:
            shell.kill()
            shell.wait()
        if pids.exists() and pids.read_text().strip():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pids.read_text()), signal.SIGKILL)


def _alive(pid: int) -> bool:
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        stat = Path(f"/proc/{pid}/stat")
        if not stat.exists() or stat.read_text().split(") ")[1].startswith("Z"):
            return False
        time.sleep(0.05)
    return True
