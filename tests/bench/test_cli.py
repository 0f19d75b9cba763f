"""bench.load.cli: the loopback-only rule, sweeps into points, every flag problem reported at once."""

from __future__ import annotations

import pytest

from bench.load.cli import DEFAULT_DURATION_S, UsageError, build_parser, check_loopback, validate
from bench.load.command import main


@pytest.mark.parametrize("url,allowed", [
    ("http://127.0.0.1:1337", True),
    ("http://localhost:3001", True),
    ("http://LOCALHOST", True),
    ("https://[::1]:8000", True),
    ("http://127.0.0.2:1337", False),
    ("http://0.0.0.0:1337", False),
    ("http://10.0.0.5:1337", False),
    ("http://example.com", False),
    ("http://localhost.example.com", False),
    ("http://127.0.0.1.nip.io", False),
    ("ftp://127.0.0.1", False),
    ("127.0.0.1:1337", False),
    ("http://127.0.0.1:notaport", False),
])
def test_only_loopback_targets(url: str, allowed: bool) -> None:
    assert (check_loopback(url) is None) is allowed


def options(*argv: str):  # type: ignore[no-untyped-def]
    return validate(build_parser().parse_args(["--url", "http://127.0.0.1:1", *argv]))


def test_closed_sweep_points() -> None:
    o = options("--concurrency", "1,8,16", "--requests", "20")
    assert [(p.mode, p.level, p.requests, p.duration) for p in o.points] == [
        ("closed", 1, 20, None), ("closed", 8, 20, None), ("closed", 16, 20, None)]
    assert [p.label for p in o.points] == ["c=1", "c=8", "c=16"]


def test_rate_means_open_loop_and_a_point_always_has_a_bound() -> None:
    o = options("--rate", "2,4.5")
    assert [(p.mode, p.level, p.requests, p.duration) for p in o.points] == [
        ("open", 2.0, None, DEFAULT_DURATION_S), ("open", 4.5, None, DEFAULT_DURATION_S)]
    assert o.points[1].label == "rate=4.5/s"


def test_every_problem_is_reported_at_once() -> None:
    with pytest.raises(UsageError) as info:
        validate(build_parser().parse_args(["--url", "http://192.168.1.2:1337", "--concurrency", "0,4",
                                            "--max-tokens", "0", "--logit-bias-ban", "a,b"]))
    message = str(info.value)
    for part in ("only loopback", "--concurrency", "--max-tokens", "--logit-bias-ban"):
        assert part in message


@pytest.mark.parametrize("argv,problem", [
    (["--mode", "open"], "needs --rate"),
    (["--mode", "closed", "--rate", "2"], "--rate is for --mode open"),
    (["--api", "openai", "--ignore-eos"], "--logit-bias-ban"),
    (["--compare-llama-cpp-server"], "--model-path"),
    (["--compare-llama-cpp-server", "--api", "openai"], "use --api infer or worker"),
    (["--compare-llama-cpp-server", "--api", "openai-chat"], "use --api infer or worker"),
    (["--api", "openai-chat", "--raw"], "--raw is not for --api openai-chat"),
    (["--api", "infer", "--worker-token", "t"], "--worker-token is for --api worker"),
])
def test_inconsistent_flags(argv: list[str], problem: str) -> None:
    with pytest.raises(UsageError, match=problem):
        options(*argv)


def test_openai_chat_needs_no_ban_list_for_ignore_eos_and_is_in_the_help() -> None:
    o = options("--api", "openai-chat", "--ignore-eos", "--model", "smol")
    assert (o.args.api, o.banned_tokens) == ("openai-chat", ())
    api = next(a for a in build_parser()._actions if a.dest == "api")
    assert "openai-chat" in (api.choices or ()) and "openai-chat: POST /v1/chat/completions" in (api.help or "")
    assert api.default == "infer"


def test_command_refuses_a_remote_url_before_sending_anything(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["--url", "http://8.8.8.8", "--requests", "1"])
    assert info.value.code == 2
    assert "only loopback targets are allowed" in capsys.readouterr().err


def test_only_api_worker_looks_for_a_worker_token() -> None:
    """The token goes only to a worker: the coordinator's API never sees it, even from the environment."""
    args = ["--url", "http://127.0.0.1:1"]
    environ = {"WORKER_TOKEN": "from-env"}
    assert validate(build_parser().parse_args([*args, "--api", "worker"]), environ).worker_token == "from-env"
    assert validate(build_parser().parse_args([*args, "--api", "infer"]), environ).worker_token is None
    assert validate(build_parser().parse_args([*args, "--api", "worker"])).worker_token is None
