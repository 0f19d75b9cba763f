"""llama.cpp's own `llama-server` as a benchmark peer, built here from the pinned llama-cpp-python sdist.

Owns: the version built (the installed llama-cpp-python's, else the pin in pyproject.toml), the cache
folder (`~/.cache/llm-pool/llama-server/<version>/`, or `$LLAMA_SERVER_CACHE/<version>/`), fetching the
sdist from PyPI's index with its sha256 checked, the cmake build of the one `llama-server` target from
the llama.cpp sources the sdist vendors (CPU, Release; its log in the cache folder), and the server's
command line, readiness wait (`GET /health`), log file and stopping it.
Must not: download a binary or anything but the sdist (the build's own downloads, the web UI's
prebuilt assets and TLS libraries, are switched off), run workloads (bench.load.compare and
bench.worker_bench do), or listen anywhere but 127.0.0.1.

    .venv/bin/python -m bench.llama_server --build     # builds once (minutes), prints the binary's path
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import importlib.metadata
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import tomllib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import httpx

from bench.processes import ServerProcess, free_port, log_tail

ROOT = Path(__file__).resolve().parent.parent
DIST = "llama-cpp-python"
CACHE_ENV = "LLAMA_SERVER_CACHE"
INDEX = "https://pypi.org/simple"
# PEP 691: the index's JSON form, which is what pip reads too (the per-release JSON API may be absent
# from a mirror; the simple index never is).
INDEX_JSON = "application/vnd.pypi.simple.v1+json"
BUILD_JOBS = 2
BUILD_TIMEOUT = 3600  # seconds for one cmake step: a build that hangs fails instead of waiting forever


# -- which version, and where ----------------------------------------------------------------------


def pinned_version(pyproject: Path = ROOT / "pyproject.toml") -> str | None:
    """The `llama-cpp-python==X` pin of the project's dependencies (or its extras), or None."""
    try:
        project = tomllib.loads(pyproject.read_text())["project"]
    except (OSError, KeyError, tomllib.TOMLDecodeError):
        return None
    requirements = list(project.get("dependencies", []))
    for extra in project.get("optional-dependencies", {}).values():
        requirements.extend(extra)
    for requirement in requirements:
        name, sep, version = requirement.partition("==")
        if sep and name.split("[")[0].strip().lower().replace("_", "-") == DIST:
            return version.split(";")[0].strip()
    return None


def installed_version() -> str | None:
    """The llama-cpp-python this environment runs (the worker's and llama_cpp.server's llama.cpp), or None."""
    try:
        return importlib.metadata.version(DIST)
    except importlib.metadata.PackageNotFoundError:
        return None


def llama_cpp_version(pyproject: Path = ROOT / "pyproject.toml") -> str:
    """The installed package's version, so every peer runs the same llama.cpp; else the project's pin."""
    version = installed_version() or pinned_version(pyproject)
    if version is None:
        raise RuntimeError(f"no llama-cpp-python installed and no `{DIST}==X` pin in {pyproject}")
    return version


def cache_root(environ: Mapping[str, str], override: Path | None = None) -> Path:
    """`override` (a flag), else $LLAMA_SERVER_CACHE, else ~/.cache/llm-pool/llama-server."""
    if override is not None:
        return override.expanduser()
    if environ.get(CACHE_ENV):
        return Path(environ[CACHE_ENV]).expanduser()
    return Path.home() / ".cache" / "llm-pool" / "llama-server"


def cpu_flags() -> str:
    """The C flags this processor needs beyond -march=native (scripts/cpu-flags.sh: AMX listed but not
    runnable), the same the bootstrap gives the worker's llama.cpp; "" for none."""
    done = subprocess.run([str(ROOT / "scripts" / "cpu-flags.sh")], capture_output=True, text=True, check=False,
                          timeout=60)
    return done.stdout.strip() if done.returncode == 0 else ""


@dataclass(frozen=True)
class Build:
    """One version's cache folder and everything in it."""

    version: str
    folder: Path
    cflags: str = ""  # beyond -march=native; a build with them has a folder of its own

    @classmethod
    def default(cls, *, version: str | None = None, cache: Path | None = None,
                environ: Mapping[str, str] | None = None) -> Build:
        v = version or llama_cpp_version()
        flags = cpu_flags()
        name = v if not flags else f"{v}-no-amx"
        return cls(v, cache_root(os.environ if environ is None else environ, cache) / name, flags)

    @property
    def sdist(self) -> Path:
        return self.folder / f"llama_cpp_python-{self.version}.tar.gz"

    @property
    def sources(self) -> Path:
        return self.folder / "src"

    @property
    def llama_cpp(self) -> Path:
        """The llama.cpp tree the sdist vendors."""
        return self.sources / f"llama_cpp_python-{self.version}" / "vendor" / "llama.cpp"

    @property
    def build_dir(self) -> Path:
        return self.folder / "build"

    @property
    def binary(self) -> Path:
        return self.build_dir / "bin" / "llama-server"

    @property
    def log_path(self) -> Path:
        return self.folder / "build.log"


# -- provisioning ----------------------------------------------------------------------------------


def sdist_link(version: str, client: httpx.Client, index: str = INDEX) -> tuple[str, str]:
    """The sdist's URL and sha256, from the index's JSON page for the project."""
    filename = f"llama_cpp_python-{version}.tar.gz"
    response = client.get(f"{index}/{DIST}/", headers={"Accept": INDEX_JSON})
    response.raise_for_status()
    for entry in response.json().get("files", []):
        if entry.get("filename") == filename and entry.get("hashes", {}).get("sha256"):
            return str(entry["url"]), str(entry["hashes"]["sha256"])
    raise RuntimeError(f"{index}/{DIST}/ lists no {filename} with a sha256")


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def fetch_sdist(build: Build, log: IO[str]) -> None:
    """Downloads the sdist next to its final name, checks its sha256, then moves it in place."""
    with httpx.Client(timeout=httpx.Timeout(60.0, connect=20.0), follow_redirects=True) as client:
        url, sha256 = sdist_link(build.version, client)
        part = build.sdist.with_suffix(".part")
        print(f"downloading {url}", file=log, flush=True)
        with client.stream("GET", url) as response, part.open("wb") as out:
            response.raise_for_status()
            for chunk in response.iter_bytes(1 << 20):
                out.write(chunk)
    got = sha256_of(part)
    if got != sha256:
        part.unlink()
        raise RuntimeError(f"{url}: sha256 {got}, the index says {sha256}")
    part.rename(build.sdist)
    print(f"sha256 {sha256} checked", file=log, flush=True)


def extract(build: Build) -> None:
    """Unpacks the sdist into a scratch folder, then renames it, so a half-unpacked tree never counts."""
    part = build.sources.with_name("src.part")
    shutil.rmtree(part, ignore_errors=True)
    with tarfile.open(build.sdist) as tar:
        tar.extractall(part, filter="data")
    shutil.rmtree(build.sources, ignore_errors=True)
    part.rename(build.sources)


def configure_argv(build: Build) -> list[str]:
    """CPU, Release, static, nothing fetched at build time (no UI assets from Hugging Face, no TLS)."""
    return ["cmake", "-S", str(build.llama_cpp), "-B", str(build.build_dir), "-DCMAKE_BUILD_TYPE=Release",
            "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF",
            "-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_BUILD_TOOLS=ON", "-DLLAMA_BUILD_TESTS=OFF",
            "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF",
            "-DGGML_CUDA=OFF", "-DGGML_METAL=OFF", "-DGGML_VULKAN=OFF",
            *([f"-DCMAKE_C_FLAGS={build.cflags}", f"-DCMAKE_CXX_FLAGS={build.cflags}"] if build.cflags else [])]


def build_argv(build: Build, jobs: int = BUILD_JOBS) -> list[str]:
    return ["cmake", "--build", str(build.build_dir), "--config", "Release", "--target", "llama-server",
            "-j", str(jobs)]


@contextlib.contextmanager
def locked(folder: Path) -> Iterator[None]:
    """One provisioning per cache folder at a time (a second benchmark waits for the first's build)."""
    folder.mkdir(parents=True, exist_ok=True)
    with (folder / ".lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def sources(build: Build | None = None) -> Path:
    """The llama.cpp source folder the sdist vendors, fetched and unpacked first when missing (no build)."""
    build = build or Build.default()
    with locked(build.folder):
        if not (build.llama_cpp / "CMakeLists.txt").is_file():
            with build.log_path.open("a") as log:
                if not build.sdist.is_file():
                    fetch_sdist(build, log)
                extract(build)
    return build.llama_cpp


def provision(build: Build | None = None, *, jobs: int = BUILD_JOBS, quiet: bool = False) -> Path:
    """The path of a built `llama-server`: at once when the cache has it, else fetched and built (minutes)."""
    build = build or Build.default()
    if build.binary.is_file() and os.access(build.binary, os.X_OK):
        return build.binary
    with locked(build.folder):
        if build.binary.is_file():  # built by another process while this one waited
            return build.binary
        if not quiet:
            print(f"building llama-server {build.version} in {build.folder} (several minutes; log "
                  f"{build.log_path}) ...", file=sys.stderr, flush=True)
        started = time.monotonic()
        with build.log_path.open("w") as log:
            try:
                if not build.sdist.is_file():
                    fetch_sdist(build, log)
                if not (build.llama_cpp / "CMakeLists.txt").is_file():
                    extract(build)
                for argv in (configure_argv(build), build_argv(build, jobs)):
                    print("$ " + " ".join(argv), file=log, flush=True)
                    try:
                        done = subprocess.run(argv, stdout=log, stderr=subprocess.STDOUT,
                                              stdin=subprocess.DEVNULL, check=False, timeout=BUILD_TIMEOUT)
                    except subprocess.TimeoutExpired:
                        raise RuntimeError(f"{argv[0]} {argv[1]} ran past {BUILD_TIMEOUT} s") from None
                    if done.returncode != 0:
                        raise RuntimeError(f"{argv[0]} {argv[1]} exited with {done.returncode}")
            except (RuntimeError, OSError, httpx.HTTPError, tarfile.TarError) as exc:
                print(f"FAILED: {exc}", file=log, flush=True)
                raise RuntimeError(f"building llama-server failed: {exc}; the end of {build.log_path}:\n"
                                   f"{log_tail(build.log_path)}") from exc
            elapsed = time.monotonic() - started
            print(f"built {build.binary} in {elapsed:.0f} s", file=log, flush=True)
        if not build.binary.is_file():
            raise RuntimeError(f"the build finished but {build.binary} is missing; see {build.log_path}")
        if not quiet:
            print(f"built llama-server in {elapsed:.0f} s", file=sys.stderr, flush=True)
    return build.binary


# -- the server ------------------------------------------------------------------------------------


def server_env(environ: Mapping[str, str]) -> dict[str, str]:
    """`environ` without llama.cpp's LLAMA_ARG_* variables: the command line alone sets the server up."""
    return {k: v for k, v in environ.items() if not k.startswith("LLAMA_ARG_")}


class LlamaServer(ServerProcess):
    """`with LlamaServer(model, threads=2, slots=4) as peer:` ... `peer.url` is its loopback base URL.

    `n_ctx` is each slot's context: llama-server splits `-c` evenly across its `-np` slots, so it gets
    n_ctx x slots. `binary` None: the build in `cache` (a cache root, see `cache_root`), built on
    `start()` when missing."""

    name = "llama-server"
    ready_path = "/health"

    def __init__(self, model_path: Path, *, threads: int, port: int | None = None, n_ctx: int = 2048,
                 slots: int = 1, binary: Path | None = None, cache: Path | None = None,
                 extra_args: Sequence[str] = (), log_path: Path | None = None,
                 startup_timeout: float = 120.0) -> None:
        if slots < 1 or n_ctx < 1 or threads < 1:
            raise ValueError("threads, n_ctx and slots must be at least 1")
        self.model_path = model_path
        self.threads = threads
        self.port = port or free_port()
        self.n_ctx = n_ctx
        self.slots = slots
        self.binary = binary
        self.cache = cache
        self.extra_args = tuple(extra_args)
        self.startup_timeout = startup_timeout
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path or Path(tempfile.gettempdir()) / f"bench-llama-server-{self.port}.log"

    def argv(self) -> list[str]:
        t = str(self.threads)
        binary = self.binary or Build.default(cache=self.cache).binary
        # Continuous batching is llama-server's default; the web UI is not needed to measure it.
        return [str(binary), "-m", str(self.model_path), "-t", t, "-tb", t,
                "-c", str(self.n_ctx * self.slots), "-np", str(self.slots),
                "--host", "127.0.0.1", "--port", str(self.port), "--no-webui", *self.extra_args]

    def env(self) -> dict[str, str]:
        return server_env(os.environ)

    def start(self) -> None:
        if self.binary is None:
            self.binary = provision(Build.default(cache=self.cache))
        super().start()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.llama_server", description=(
        "Build llama.cpp's llama-server from the llama-cpp-python sdist (the installed version, else "
        "pyproject.toml's pin) into a cache folder, once; print the binary's path."))
    parser.add_argument("--build", action="store_true", help="build it if the cache does not have it yet")
    parser.add_argument("--sources", action="store_true",
                        help="only fetch and unpack the sources; print their folder (bench/gpu_check.sh builds them "
                             "for a GPU elsewhere)")
    parser.add_argument("--cache", type=Path,
                        help=f"cache root (default ${CACHE_ENV}, else ~/.cache/llm-pool/llama-server); "
                             "a folder per version in it")
    parser.add_argument("--llama-cpp-version", dest="llama_version",
                        help="llama-cpp-python version (default: the installed one, else the pin)")
    parser.add_argument("--jobs", type=int, default=BUILD_JOBS, help="parallel compile jobs")
    args = parser.parse_args(argv)
    build = Build.default(version=args.llama_version, cache=args.cache)
    if args.sources:
        try:
            print(sources(build))
        except (RuntimeError, OSError, httpx.HTTPError, tarfile.TarError) as exc:
            print(f"fetching the sources failed: {exc}", file=sys.stderr)
            return 1
        return 0
    if args.build:
        try:
            print(provision(build, jobs=args.jobs))
        except RuntimeError as exc:
            print(exc, file=sys.stderr)
            return 1
        return 0
    if not build.binary.is_file():
        print(f"not built yet: {build.binary} (run with --build)", file=sys.stderr)
        return 1
    print(build.binary)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
