"""worker/models/folder.py: the model a folder starts a worker on, the budget, and the offers as a heartbeat
lists them (the served one as loaded, a broken file as unavailable with its reason, names a request can use)."""

from __future__ import annotations

from pathlib import Path

import pytest

from protocol.health import Heartbeat, WorkerLoad
from worker.models.folder import MARGIN_BYTES, FolderError, budget_bytes, listed, open_folder
from worker.naming import ModelNames
from worker.settings import WorkerSettings

pytestmark = pytest.mark.model


def folder_of(tmp_path: Path, model_path: Path, gemma_path: Path) -> Path:
    (tmp_path / "a-broken.gguf").write_text("not a model")
    (tmp_path / "b gemma.gguf").symlink_to(gemma_path)  # a stem with a space: no alias of it
    (tmp_path / "c-smol.gguf").symlink_to(model_path)
    return tmp_path


def test_without_a_model_the_worker_serves_the_first_model_the_folder_offers(
        model_path: Path, gemma_path: Path, tmp_path: Path) -> None:
    settings = WorkerSettings.load(["--model-dir", str(folder_of(tmp_path, model_path, gemma_path))])
    chosen, offers = open_folder(settings)
    assert chosen.model_path == tmp_path / "b gemma.gguf"
    assert [(o.path.name, o.state) for o in offers] == [
        ("a-broken.gguf", "unavailable"), ("b gemma.gguf", "offered"), ("c-smol.gguf", "offered")]
    # A --model given is kept, the folder still listed beside it.
    given = WorkerSettings.load(["--model-dir", str(tmp_path), "--model-path", str(model_path)])
    assert open_folder(given)[0].model_path == model_path


def test_the_heartbeat_lists_every_file_with_the_served_one_loaded(
        model_path: Path, gemma_path: Path, tmp_path: Path) -> None:
    settings = WorkerSettings.load(["--model-dir", str(folder_of(tmp_path, model_path, gemma_path)),
                                    "--model-path", str(tmp_path / "c-smol.gguf")])
    _, offers = open_folder(settings)
    names = ModelNames("smol", ("c-smol",))
    shown = listed(offers, model_path, names)  # the same file, by another path
    assert [(o.name, o.state) for o in shown] == [
        ("a-broken", "unavailable"), ("gemma-3-270m", "offered"), ("smol", "loaded")]
    assert shown[0].reason == "not a GGUF file (its first bytes are not GGUF)" and shown[0].need_bytes == 0
    assert shown[1].aliases == [] and shown[1].need_bytes > gemma_path.stat().st_size
    assert shown[2].aliases == ["c-smol"] and shown[2].identity.startswith("gguf:")
    Heartbeat(worker_id="w1", url="http://w1.test", model="smol", load=WorkerLoad(
        sessions=0, max_sessions=1, active_streams=0, queue_depth=0, kv_used_bytes=0, kv_reserved_bytes=0,
        kv_capacity_bytes=1, bytes_per_token=1, session_max_tokens=1), timestamp=1.0, offered=shown)


def test_a_folder_with_nothing_to_serve_says_why_and_a_missing_one_is_named(tmp_path: Path) -> None:
    (tmp_path / "x.gguf").write_bytes(b"")
    with pytest.raises(FolderError, match=r"no model in .* can be served \(x.gguf: the file ends inside its header\)"):
        open_folder(WorkerSettings.load(["--model-dir", str(tmp_path)]))
    with pytest.raises(FolderError, match="is not a folder"):
        open_folder(WorkerSettings.load(["--model-dir", str(tmp_path / "nowhere")]))


def test_the_budget_is_the_setting_or_the_machine_less_its_margin() -> None:
    assert budget_bytes(WorkerSettings(model_memory=5_000)) == 5_000
    assert budget_bytes(WorkerSettings(), total=4 * MARGIN_BYTES) == 3 * MARGIN_BYTES
    assert budget_bytes(WorkerSettings(), total=20 * MARGIN_BYTES) == 18 * MARGIN_BYTES
