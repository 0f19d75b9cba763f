"""Engine backends by name: each registers itself in its own module (`BACKEND`), `--engine` takes the
names found, and what an engine can do beyond every engine's part is found at start."""

from __future__ import annotations

import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

import worker.backends
from tests.sse import generate
from tests.worker.server import running_worker
from worker.__main__ import main
from worker.backends import backend, backends, build_embedding_context
from worker.backends.base import KvTransfer, PrefixExport
from worker.backends.llama_engine import Engine
from worker.backends.simulated import SimulatedEngine, SimulatedModel
from worker.settings import WorkerSettings

ECHO = textwrap.dedent('''
    """A backend added as one module: the simulated engine's parts at 1,000 tokens a second, no embeddings."""
    from worker.backends.plugin import Backend
    from worker.backends.simulated import SimulatedEngine, SimulatedModel

    BACKEND = Backend(
        "echo", lambda settings: SimulatedModel(bytes_per_token=64),
        lambda settings, model, config, observer, clock: SimulatedEngine(
            model, config, token_rate=1000.0, prefill_rate=1e6, observer=observer, clock=clock))
''')


@pytest.fixture
def echo(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A backend module dropped next to the others (its folder added to the package's path)."""
    (tmp_path / "echo_backend.py").write_text(ECHO)
    monkeypatch.setattr(worker.backends, "__path__", [*worker.backends.__path__, str(tmp_path)])
    backends.cache_clear()
    yield "echo"
    backends.cache_clear()
    sys.modules.pop("worker.backends.echo_backend", None)


def test_the_backends_present_are_found_by_their_names() -> None:
    assert {"llama", "simulated"} <= set(backends())
    with pytest.raises(ValueError, match="known: .*llama.*simulated"):
        backend("nope")


def test_an_engine_no_backend_registers_is_refused_from_the_flags_and_from_the_environment(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as flags:
        main(["--engine", "nope"])
    assert flags.value.code == 2
    monkeypatch.setenv("WORKER_ENGINE", "nope")
    assert main([]) == 2
    assert "engine 'nope' is none of" in capsys.readouterr().err


def test_what_an_engine_can_do_beyond_every_engines_part_is_found_by_what_it_implements() -> None:
    assert issubclass(Engine, PrefixExport) and issubclass(Engine, KvTransfer)
    assert not issubclass(SimulatedEngine, KvTransfer)


def test_an_engine_whose_cells_cannot_move_refuses_those_routes_naming_its_engine(tmp_path: Path) -> None:
    with running_worker(tmp_path / "none.gguf", engine="simulated") as worker:
        put = httpx.put(worker.url + "/worker/sessions/s1/kv", content=b"x" * 64, timeout=10)
        assert put.status_code == 400 and "engine (simulated)" in put.json()["error"]
        prefix = httpx.post(worker.url + "/worker/prefix", json={"tokens": [1, 2, 3], "at_least": 2}, timeout=10)
        assert prefix.status_code == 400 and "exports no prompt prefixes" in prefix.json()["error"]
        # and a peer is never asked: the prompt is prefilled here
        stream = generate(worker.url, {"prompt": "hello", "max_tokens": 3, "prefix_peer": "http://127.0.0.1:9"})
        assert stream.last[0] == "done"


def test_a_backend_is_added_as_one_module(echo: str, tmp_path: Path) -> None:
    assert echo in backends()
    with running_worker(tmp_path / "none.gguf", engine=echo, embeddings=False) as worker:
        stream = generate(worker.url, {"prompt": "hello", "max_tokens": 5})
        assert stream.last[0] == "done" and len(stream.tokens) == 5
    settings = WorkerSettings(engine=echo, model_path=tmp_path / "none.gguf")
    with pytest.raises(ValueError, match="--no-embeddings"):  # it has no embedding context
        build_embedding_context(settings, SimulatedModel(bytes_per_token=64))
