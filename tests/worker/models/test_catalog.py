"""worker/models: a folder's GGUF files read without their weights. The shape read from a header must be
the one llama.cpp reports once the model is loaded (it sizes every KV reservation), for both models the
project ships; a corrupt, truncated or unreadable file is listed as unavailable with its reason, and a
model past the memory budget as too large, with both numbers."""

from __future__ import annotations

import shutil
import struct
from pathlib import Path

import pytest

from worker.backends.llama_model import Model
from worker.models import catalog
from worker.models.catalog import Offer, Sizing, offer, scan
from worker.models.gguf import GgufError, read_header

pytestmark = pytest.mark.model
SIZING = Sizing(sessions=4, session_tokens=512)


@pytest.mark.parametrize("which", ["smollm2", "gemma3"])
def test_the_shape_from_the_header_is_the_one_llama_cpp_loads(which: str, model_path: Path,
                                                               request: pytest.FixtureRequest) -> None:
    path = model_path if which == "smollm2" else request.getfixturevalue("gemma_path")
    found = offer(path, SIZING)
    loaded = Model(path)
    try:
        assert found.state == "offered" and found.shape == loaded.shape
        assert found.kv_bytes == 4 * 512 * loaded.bytes_per_token and found.weight_bytes == path.stat().st_size
        assert found.identity == loaded.identity and found.names is not None
    finally:
        loaded.close()


def test_a_folder_lists_every_file_with_its_verdict(model_path: Path, tmp_path: Path) -> None:
    shutil.copy(model_path, tmp_path / "b-smol.gguf")
    (tmp_path / "a-empty.gguf").write_bytes(b"")
    (tmp_path / "c-text.gguf").write_text("not a model")
    data = model_path.read_bytes()[:4096]  # the header cut off
    (tmp_path / "d-cut.gguf").write_bytes(data)
    (tmp_path / "notes.txt").write_text("not listed")
    offers = {o.path.name: o for o in scan(tmp_path, SIZING)}
    assert sorted(offers) == ["a-empty.gguf", "b-smol.gguf", "c-text.gguf", "d-cut.gguf"]
    assert offers["b-smol.gguf"].state == "offered"
    assert offers["b-smol.gguf"].names is not None and "b-smol" in offers["b-smol.gguf"].names.aliases
    assert {name: (o.state, o.reason) for name, o in offers.items() if name != "b-smol.gguf"} == {
        "a-empty.gguf": ("unavailable", "the file ends inside its header"),
        "c-text.gguf": ("unavailable", "not a GGUF file (its first bytes are not GGUF)"),
        "d-cut.gguf": ("unavailable", "the file ends inside its header")}


def test_a_scan_again_reads_only_the_files_that_changed(model_path: Path, gemma_path: Path, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "a.gguf").symlink_to(model_path)
    (tmp_path / "b.gguf").write_text("not a model")
    judged: dict[Path, Offer] = {}
    first = scan(tmp_path, SIZING, judged)
    reads: list[str] = []
    monkeypatch.setattr(catalog, "read_header", lambda path: reads.append(path.name) or read_header(path))
    assert scan(tmp_path, SIZING, judged) == first and reads == []  # nothing changed: nothing read
    (tmp_path / "b.gguf").write_text("still not a model, longer")  # written over
    (tmp_path / "a.gguf").unlink()
    (tmp_path / "a.gguf").symlink_to(gemma_path)  # replaced under the same name
    again = {o.path.name: o for o in scan(tmp_path, SIZING, judged)}
    assert sorted(reads) == ["a.gguf", "b.gguf"] and set(judged) == {tmp_path / "a.gguf", tmp_path / "b.gguf"}
    assert again["a.gguf"].identity != first[0].identity and again["a.gguf"].names != first[0].names
    (tmp_path / "b.gguf").unlink()
    assert [o.path.name for o in scan(tmp_path, SIZING, judged)] == ["a.gguf"] and set(judged) == {tmp_path / "a.gguf"}


def test_a_model_past_the_budget_is_too_large_with_both_numbers(model_path: Path) -> None:
    need = offer(model_path, SIZING).need_bytes
    assert offer(model_path, Sizing(4, 512, budget_bytes=need)).state == "offered"
    refused = offer(model_path, Sizing(4, 512, budget_bytes=need - 1))
    assert refused.state == "too_large" and f"{need:,}" in refused.reason and f"{need - 1:,}" in refused.reason


@pytest.mark.parametrize("patch, named", [
    (lambda b: b[:4] + struct.pack("<I", 9) + b[8:], "version 9"),
    (lambda b: b[:16] + struct.pack("<Q", 1 << 40) + b[24:], "metadata keys"),
])
def test_a_header_past_what_is_read_is_refused_by_name(patch: object, named: str, model_path: Path,
                                                       tmp_path: Path) -> None:
    path = tmp_path / "bad.gguf"
    path.write_bytes(patch(model_path.read_bytes()[:1 << 16]))  # type: ignore[operator]
    with pytest.raises(GgufError, match=named):
        read_header(path)
