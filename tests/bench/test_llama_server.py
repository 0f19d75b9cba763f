"""llama-server as a peer: its command line, where its build is cached, which version it builds, and the
flags that select it in bench.load and bench.worker_bench. No building, no network, no process started."""

from __future__ import annotations

import argparse
import importlib.metadata
from pathlib import Path

import pytest

from bench import llama_server, worker_bench
from bench.llama_server import CACHE_ENV, Build, LlamaServer, cache_root, pinned_version, server_env
from bench.load.cli import UsageError, build_parser, validate
from bench.load.compare import ratio_table
from bench.load.peer import LLAMA_CPP_SERVER, LLAMA_SERVER, LlamaCppServer, make_peer

ROOT = Path(__file__).resolve().parents[2]


def flag_value(argv: list[str], *names: str) -> str:
    for i, arg in enumerate(argv):
        if arg in names:
            return argv[i + 1]
    raise AssertionError(f"none of {names} in {argv}")


def test_command_line_threads_context_per_slot_and_loopback(tmp_path: Path) -> None:
    binary = tmp_path / "llama-server"
    peer = LlamaServer(Path("/models/m.gguf"), threads=3, port=4321, n_ctx=1024, slots=4, binary=binary)
    argv = peer.argv()
    assert argv[0] == str(binary)
    assert flag_value(argv, "-m") == "/models/m.gguf"
    assert flag_value(argv, "-t") == flag_value(argv, "-tb") == "3"
    assert flag_value(argv, "-c") == "4096"  # llama-server splits -c across its slots: 1024 each
    assert flag_value(argv, "-np") == "4"
    assert (flag_value(argv, "--host"), flag_value(argv, "--port")) == ("127.0.0.1", "4321")
    assert "--no-webui" in argv
    assert peer.url == "http://127.0.0.1:4321"


def test_extra_args_come_last_and_a_free_port_is_picked(tmp_path: Path) -> None:
    peer = LlamaServer(Path("m.gguf"), threads=1, binary=tmp_path / "b", extra_args=("--cache-ram", "0"))
    assert peer.argv()[-2:] == ["--cache-ram", "0"]
    assert flag_value(peer.argv(), "-c") == "2048" and flag_value(peer.argv(), "-np") == "1"
    assert 0 < peer.port < 65536 and peer.url.startswith("http://127.0.0.1:")


def test_bad_sizes_are_refused() -> None:
    with pytest.raises(ValueError):
        LlamaServer(Path("m.gguf"), threads=1, slots=0)


def test_without_a_binary_the_command_names_the_cached_build(tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    peer = LlamaServer(Path("m.gguf"), threads=1)
    version = llama_server.llama_cpp_version()
    assert peer.argv()[0] == str(tmp_path / version / "build" / "bin" / "llama-server")


def test_llama_arg_variables_do_not_reach_the_server() -> None:
    env = server_env({"PATH": "/bin", "LLAMA_ARG_N_PARALLEL": "8", "LLAMA_ARG_HOST": "0.0.0.0"})
    assert env == {"PATH": "/bin"}


def test_cache_root_flag_then_env_then_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_root({}) == tmp_path / "home" / ".cache" / "llm-pool" / "llama-server"
    assert cache_root({CACHE_ENV: str(tmp_path / "env")}) == tmp_path / "env"
    assert cache_root({CACHE_ENV: ""}) == tmp_path / "home" / ".cache" / "llm-pool" / "llama-server"
    assert cache_root({CACHE_ENV: str(tmp_path / "env")}, tmp_path / "flag") == tmp_path / "flag"


@pytest.fixture(autouse=True)
def _native_processor(monkeypatch: pytest.MonkeyPatch) -> None:
    """These tests describe a processor that needs no flags beyond -march=native (whatever this one is)."""
    monkeypatch.setattr(llama_server, "cpu_flags", lambda: "")


def test_a_processor_that_needs_other_flags_gets_a_build_folder_of_its_own(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(llama_server, "cpu_flags", lambda: "-mno-amx-tile")
    build = Build.default(version="1.2.3", cache=tmp_path)
    assert build.folder == tmp_path / "1.2.3-no-amx" and build.cflags == "-mno-amx-tile"


def test_build_layout_is_one_folder_per_version(tmp_path: Path) -> None:
    build = Build.default(version="1.2.3", environ={CACHE_ENV: str(tmp_path)})
    assert build.folder == tmp_path / "1.2.3"
    assert build.sdist == tmp_path / "1.2.3" / "llama_cpp_python-1.2.3.tar.gz"
    assert build.llama_cpp == tmp_path / "1.2.3" / "src" / "llama_cpp_python-1.2.3" / "vendor" / "llama.cpp"
    assert build.binary == tmp_path / "1.2.3" / "build" / "bin" / "llama-server"
    assert build.log_path.parent == build.folder


def test_a_cached_binary_is_returned_at_once(tmp_path: Path) -> None:
    build = Build("1.2.3", tmp_path / "1.2.3")
    build.binary.parent.mkdir(parents=True)
    build.binary.write_text("#!/bin/sh\n")
    build.binary.chmod(0o755)
    assert llama_server.provision(build, quiet=True) == build.binary  # no download, no cmake
    assert not build.sdist.exists()


def test_the_build_is_cpu_release_one_target_and_fetches_nothing(tmp_path: Path) -> None:
    build = Build("1.2.3", tmp_path)
    configure = llama_server.configure_argv(build)
    assert configure[:5] == ["cmake", "-S", str(build.llama_cpp), "-B", str(build.build_dir)]
    for option in ("-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_CURL=OFF", "-DBUILD_SHARED_LIBS=OFF",
                   "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_BUILD_UI=OFF", "-DGGML_CUDA=OFF"):
        assert option in configure
    assert llama_server.build_argv(build, 2)[-4:] == ["--target", "llama-server", "-j", "2"]
    assert not any(option.startswith("-DCMAKE_C_FLAGS") for option in configure)
    # A processor that lists AMX but cannot run it: the same flags as the worker's llama.cpp.
    amx = llama_server.configure_argv(Build("1.2.3", tmp_path, "-mno-amx-tile"))
    assert "-DCMAKE_C_FLAGS=-mno-amx-tile" in amx and "-DCMAKE_CXX_FLAGS=-mno-amx-tile" in amx


def test_version_is_the_installed_package_else_the_pin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pinned = pinned_version(ROOT / "pyproject.toml")
    assert pinned is not None and pinned.count(".") == 2
    assert llama_server.llama_cpp_version() == importlib.metadata.version("llama-cpp-python")
    pyproject = tmp_path / "pyproject.toml"
    pyproject.write_text('[project]\ndependencies = ["httpx>=0.27", "llama_cpp_python[server] == 9.8.7"]\n')
    assert pinned_version(pyproject) == "9.8.7"
    monkeypatch.setattr(llama_server, "installed_version", lambda: None)
    assert llama_server.llama_cpp_version(pyproject) == "9.8.7"
    pyproject.write_text('[project]\ndependencies = ["httpx"]\n')
    with pytest.raises(RuntimeError, match="no llama-cpp-python"):
        llama_server.llama_cpp_version(pyproject)


def test_main_without_build_says_where_it_would_be(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert llama_server.main(["--cache", str(tmp_path), "--llama-cpp-version", "1.2.3"]) == 1
    assert str(tmp_path / "1.2.3" / "build" / "bin" / "llama-server") in capsys.readouterr().err


# -- bench.load ------------------------------------------------------------------------------------


def load_args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["--url", "http://127.0.0.1:1", *argv])


def test_bench_load_accepts_the_llama_server_flags(tmp_path: Path) -> None:
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    options = validate(load_args("--compare-llama-server", "--model-path", str(model), "--threads", "2",
                                 "--peer-slots", "8", "--peer-ctx", "512", "--peer-port", "4321",
                                 "--llama-server-cache", str(tmp_path)))
    a = options.args
    assert (a.compare_llama_server, a.compare_llama_cpp_server, a.peer_slots, a.peer_ctx) == (True, False, 8, 512)
    assert options.peer == LLAMA_SERVER
    peer = make_peer(LLAMA_SERVER, a.model_path, threads=a.threads, port=a.peer_port, n_ctx=a.peer_ctx,
                     slots=a.peer_slots, cache=a.llama_server_cache)
    assert isinstance(peer, LlamaServer) and peer.name == "llama-server"
    argv = peer.argv()
    assert (flag_value(argv, "-c"), flag_value(argv, "-np"), flag_value(argv, "--port")) == ("4096", "8", "4321")
    assert argv[0].startswith(str(tmp_path))


def test_bench_load_without_the_new_flag_is_unchanged(tmp_path: Path) -> None:
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    options = validate(load_args("--compare-llama-cpp-server", "--model-path", str(model), "--threads", "2"))
    assert options.peer == LLAMA_CPP_SERVER
    assert isinstance(make_peer(LLAMA_CPP_SERVER, model, threads=2, port=None, n_ctx=2048), LlamaCppServer)
    assert validate(load_args()).peer is None
    assert ratio_table([]).endswith("ratio = ours / llama_cpp.server; TTFT in ms (a ratio below 1 is better "
                                    "for TTFT)")
    assert "ratio = ours / llama-server;" in ratio_table([], "llama-server")


@pytest.mark.parametrize("argv,problem", [
    (["--compare-llama-server"], "--compare-llama-server needs --model-path"),
    (["--compare-llama-server", "--api", "openai"], "--compare-llama-server measures ours"),
    (["--compare-llama-server", "--compare-llama-cpp-server"], "one peer per run"),
    (["--peer-slots", "4"], "--peer-slots is for --compare-llama-server"),
    (["--compare-llama-server", "--peer-slots", "0"], "--peer-slots must be positive"),
])
def test_bench_load_refuses_inconsistent_llama_server_flags(argv: list[str], problem: str) -> None:
    with pytest.raises(UsageError, match=problem):
        validate(load_args(*argv))


# -- bench.worker_bench ----------------------------------------------------------------------------


def test_worker_bench_selects_llama_server_only_when_named() -> None:
    assert "llama-server" not in worker_bench.parse_args([]).peers
    args = worker_bench.parse_args(["--peers", "worker,llama-server", "--streams", "4", "--tokens", "32",
                                    "--reps", "1", "--llama-server-cache", "/tmp/x"])
    assert args.peers == ["worker", "llama-server"] and args.llama_server_cache == Path("/tmp/x")
    assert worker_bench.PEER_NAMES["llama-server"] == "llama-server"


def test_bench_load_writes_the_cache_flag_into_its_json(tmp_path: Path) -> None:
    import json

    from bench.load.command import finish

    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    out = tmp_path / "out.json"
    options = validate(load_args("--compare-llama-server", "--model-path", str(model), "--threads", "1",
                                 "--llama-server-cache", str(tmp_path / "cache"), "--out", str(out)))
    finish(options, {"ours": [], "llama-server": []})
    config = json.loads(out.read_text())["config"]
    assert config["llama_server_cache"] == str(tmp_path / "cache") and config["compare_llama_server"] is True


def test_sources_already_unpacked_are_returned_without_a_download(tmp_path: Path) -> None:
    build = Build("1.2.3", tmp_path / "1.2.3")
    build.llama_cpp.mkdir(parents=True)
    (build.llama_cpp / "CMakeLists.txt").write_text("project(x)\n")
    assert llama_server.sources(build) == build.llama_cpp
    assert not build.sdist.exists()


def test_worker_bench_on_a_gpu_gives_every_peer_the_sequences_and_the_layers() -> None:
    args = worker_bench.parse_args(["--peers", "worker,ceiling,llama-server", "--sessions", "64",
                                    "--streams", "1,16,64", "--gpu-layers", "999",
                                    "--llama-server-bin", "/opt/llama-server"])
    assert args.streams == [1, 16, 64] and args.sessions == 64
    assert args.llama_server_bin == Path("/opt/llama-server")
    assert worker_bench.llama_server_args(args) == ("--cache-ram", "0", "-ngl", "999")
    # Without the flag every peer keeps its own default, and the server is not told a layer count.
    assert worker_bench.llama_server_args(worker_bench.parse_args([])) == ("--cache-ram", "0")


def test_worker_bench_streams_are_bounded_by_the_sequences() -> None:
    with pytest.raises(SystemExit):
        worker_bench.parse_args(["--streams", "32"])  # the default 16 sequences
    with pytest.raises(SystemExit):
        worker_bench.parse_args(["--sessions", "0"])
