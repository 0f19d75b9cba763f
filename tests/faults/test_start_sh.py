"""`./start.sh` as an operator meets it: a token by default, one worker's death restarts that worker
and leaves the other serving, Ctrl+C drains, and a model that cannot load stops the start with its
reason (before: one crash stopped the whole pool, and a bad model answered 503 loading forever)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO

import httpx
import pytest

from bench.processes import port_is_free
from tests.conftest import WITH_DEFAULT_SIGINT, free_port
from tests.polling import wait_until

pytestmark = pytest.mark.model
ROOT = Path(__file__).resolve().parents[2]


def launch(tmp_path: Path, *extra: str) -> tuple[subprocess.Popen[bytes], str, Path, int]:
    port, worker_port = free_port(), free_port()
    while worker_port + 1 == port or not port_is_free(worker_port + 1):  # start.sh uses the next one too
        worker_port = free_port()
    log_dir = tmp_path / "pool"
    env = {k: v for k, v in os.environ.items() if k not in ("WORKER_TOKEN", "PORT", "HOST", "MODEL_PATH")}
    env["LOG_DIR"] = str(log_dir)
    proc = subprocess.Popen([*WITH_DEFAULT_SIGINT, str(ROOT / "start.sh"), "--port", str(port), "--worker-port", str(worker_port),
                             "--drain-timeout", "5", *extra], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True)
    return proc, f"http://127.0.0.1:{port}", log_dir, worker_port


def up(proc: subprocess.Popen[bytes], output: Output) -> bool:
    """start.sh says its pool is up; a start.sh that ended fails at once, with what it printed."""
    assert proc.poll() is None, f"start.sh exited ({proc.returncode}):\n{output.text[-3000:]}"
    return "Press Ctrl+C" in output.text


class Output:
    """start.sh's output, read as it comes (so the pipe never fills)."""

    def __init__(self, proc: subprocess.Popen[bytes]) -> None:
        self.text = ""
        assert proc.stdout is not None
        self._thread = threading.Thread(target=self._read, args=(proc.stdout,), daemon=True)
        self._thread.start()

    def _read(self, stream: IO[bytes]) -> None:
        for line in stream:
            self.text += line.decode(errors="replace")

    def finished(self) -> str:
        self._thread.join(timeout=10)
        return self.text


@pytest.fixture
def pool(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[bytes], str, Path, int, Output]]:
    proc, url, log_dir, worker_port = launch(tmp_path)
    out = Output(proc)
    try:
        # Ready once start.sh itself says so (its own health check done), not merely the coordinator.
        wait_until(lambda: proc.poll() is None and "Press Ctrl+C" in out.text, 180, "start.sh's pool to be up",
                   interval=0.2)
        yield proc, url, log_dir, worker_port, out
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)


def worker_pid(worker_port: int) -> int | None:
    """The pid of the worker start.sh runs on that port (read from /proc: ps may cut long command lines)."""
    want = ["-m", "worker", "--host", "127.0.0.1", "--port", str(worker_port)]
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        if argv[1:1 + len(want)] == want:
            return int(entry.name)
    return None


def test_a_dead_worker_is_restarted_and_the_other_keeps_serving_then_ctrl_c_drains(
        pool: tuple[subprocess.Popen[bytes], str, Path, int, Output]) -> None:
    proc, url, log_dir, worker_port, output = pool
    token = (log_dir / "worker-token").read_text().strip()
    assert len(token) >= 24 and (log_dir / "worker-token").stat().st_mode & 0o077 == 0
    beat = httpx.post(url + "/coordinator/health/heartbeat", json={}, timeout=5)
    assert beat.status_code == 401  # secure by default: no token, no registration
    before = {w["worker_id"]: w["url"] for w in httpx.get(url + "/coordinator/health/workers", timeout=5)
              .json()["workers"]}
    victim = worker_pid(worker_port)
    assert victim is not None
    os.kill(victim, signal.SIGKILL)
    for _ in range(5):  # the other worker serves throughout (a request sent to the dead one fails over)
        answer = httpx.post(url + "/coordinator/infer", json={"prompt": "Hi", "max_tokens": 4}, timeout=30)
        assert answer.status_code == 200 and b"event: done" in answer.content, answer.text
    wait_until(lambda: worker_pid(worker_port) not in (None, victim), 20, "worker-1 restarted")
    wait_until(lambda: {w["worker_id"]: w["state"] for w in httpx.get(url + "/coordinator/health/workers",
                        timeout=5).json()["workers"]}.get("worker-1") == "alive", 60, "worker-1 back")
    assert proc.poll() is None and set(before) == {"worker-1", "worker-2"}
    # Ctrl+C with a stream running: it finishes (within the drain), then everything stops.
    with httpx.Client(timeout=60) as client, client.stream(
            "POST", url + "/coordinator/infer", json={"prompt": "Count.", "max_tokens": 24, "ignore_eos": True}
    ) as stream:
        lines = stream.iter_lines()
        assert any(line.startswith("event: token") for line in lines)
        os.killpg(proc.pid, signal.SIGINT)
        rest = list(lines)
    assert any(line.startswith("event: done") for line in rest), rest[-5:]  # as README promises: it finishes
    # 130 when start.sh's own trap ran first, 0 when it saw the coordinator finish its drain first.
    assert proc.wait(timeout=30) in (0, 130)
    out = output.finished()
    assert "restarting it (1 of 3)" in out and "the coordinator exited" not in out


def test_a_model_that_cannot_load_stops_the_start_with_its_reason(tmp_path: Path) -> None:
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF" + b"\0" * 64)
    proc, _, _, _ = launch(tmp_path, "--workers", "1", "--model", str(broken))
    code, out = ended(proc)
    assert code == 1 and "did not become healthy" in out and "could not be loaded" in out, out[-2000:]


def ended(proc: subprocess.Popen[bytes]) -> tuple[int, str]:
    """A start.sh that stops by itself: its exit status and what it printed (killed after 120 s)."""
    output = Output(proc)
    try:
        code = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    return code, output.finished()


def test_the_worker_itself_exits_non_zero_when_its_model_cannot_load(tmp_path: Path) -> None:
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"not a model")
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "worker", "--port", str(free_port()), "--model-path", str(broken)],
                          check=False, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and "could not be loaded" in done.stderr
    assert time.monotonic() - started < 60


def coordinator_pid(own_port: int) -> int | None:
    """The pid of the coordinator start.sh runs with that port of its own (OWN_PORT in its environment)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if argv[1:3] == [b"-m", b"coordinator"] and f"OWN_PORT={own_port}".encode() in environ:
            return int(entry.name)
    return None


def test_with_two_coordinators_one_killed_and_restarted_refuses_nothing(tmp_path: Path) -> None:
    """Issue 33's restart: before, one second after the kill 18 of 20 requests got `503 no_workers`
    from the restarted process, which took connections on the shared port before it knew a worker."""
    proc, url, _, _ = launch(tmp_path, "--coordinators", "2")
    output = Output(proc)
    try:
        wait_until(lambda: up(proc, output), 180, "start.sh's pool to be up", interval=0.2)
        own_port = int(url.rsplit(":", 1)[1]) + 1
        victim = coordinator_pid(own_port)
        assert victim is not None
        os.kill(victim, signal.SIGKILL)
        wait_until(lambda: coordinator_pid(own_port) not in (None, victim), 20, "coordinator-1 restarted")
        time.sleep(1.0)
        codes = []
        for _ in range(20):
            with httpx.Client(timeout=30) as client:  # a connection each: the kernel picks the process
                codes.append(client.post(url + "/coordinator/infer", json={"prompt": "Hi", "max_tokens": 2}).status_code)
        assert codes == [200] * 20, codes
        own = f"http://127.0.0.1:{own_port}"
        wait_until(lambda: httpx.get(own + "/coordinator/ready", timeout=2).status_code == 200, 15,
                   "coordinator-1 ready again")  # within a heartbeat round (10 s) of its start
        assert "restarting it (1 of 3)" in output.text
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGINT)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)


CRASHES = ("Segmentation fault", "Aborted", "Fatal Python error", "terminate called", "core dumped")


def test_a_key_file_the_coordinator_refuses_stops_the_start_and_every_worker_cleanly(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 50: the coordinator refused its key file at start, and start.sh's stop of the workers (then
    loading their model) ended one in `Segmentation fault` and the other in `Aborted`."""
    keys = tmp_path / "keys"
    keys.write_text("a key with spaces and : punctuation\n")
    keys.chmod(0o600)
    monkeypatch.setenv("API_KEYS", str(keys))  # launch passes this process's environment on
    proc, _, log_dir, _ = launch(tmp_path)
    code, out = ended(proc)
    assert code == 1 and "did not become healthy" in out and "api_keys" in out, out[-2000:]
    logs = {f.name: f.read_text(errors="replace") for f in log_dir.glob("worker-*.log")}
    assert len(logs) == 2
    assert not [c for c in CRASHES if c in out or any(c in log for log in logs.values())], (out[-2000:], logs)


@pytest.mark.parametrize("after", [0.0, 0.2, 0.4, 0.7, 1.0])
def test_a_worker_stopped_while_its_model_loads_exits_cleanly(model_path: Path, tmp_path: Path, after: float) -> None:
    """SIGTERM `after` seconds into the load (its thread reading the model, or making a context on it):
    the worker waits for the thread, frees what it made, and exits 0. Before, freeing the model under
    the thread segfaulted, and exiting under it aborted."""
    log = tmp_path / "worker.log"
    with log.open("wb") as sink:
        proc = subprocess.Popen([sys.executable, "-m", "worker", "--port", str(free_port()), "--threads", "1",
                                 "--coordinator-url", "http://127.0.0.1:9", "--model-path", str(model_path)],
                                cwd=ROOT, stdout=sink, stderr=subprocess.STDOUT, env={**os.environ,
                                                                                       "PYTHONFAULTHANDLER": "1"})
    try:
        wait_until(lambda: "Application startup complete" in log.read_text(errors="replace"), 60,
                   "the load to start", interval=0.02)
        time.sleep(after)
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
    text = log.read_text(errors="replace")
    assert code == 0 and not [c for c in CRASHES if c in text], text[-3000:]
