"""The Dockerfile: two stages, llama.cpp built once in the builder at pyproject.toml's pin, a runtime
stage without compilers that runs as an unprivileged user, no model inside, and commands that exist."""

from __future__ import annotations

import re
import shlex

from tests.deploy.contract import console_scripts, default_port, llama_cpp_pin
from tests.deploy.manifests import ROOT

DOCKERFILE = ROOT / "Dockerfile"


def _instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments dropped."""
    joined = re.sub(r"\\\n", " ", "\n".join(line for line in DOCKERFILE.read_text().splitlines()
                                           if not line.lstrip().startswith("#")))
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1] if " " in line.strip() else "")
            for line in joined.splitlines() if line.strip()]


def _stages() -> dict[str, list[tuple[str, str]]]:
    stages: dict[str, list[tuple[str, str]]] = {}
    current: list[tuple[str, str]] = []
    for instruction, args in _instructions():
        if instruction == "FROM":
            current = []
            stages[args.split()[-1]] = current
        current.append((instruction, args))
    return stages


def test_two_stages_builder_then_runtime() -> None:
    assert list(_stages()) == ["builder", "runtime"]
    runtime = _stages()["runtime"]
    copies = [args for instruction, args in runtime if instruction == "COPY"]
    assert copies == ["--from=builder /opt/venv /opt/venv"], "the runtime takes the built venv and nothing else"


def test_llama_cpp_is_built_once_at_the_projects_pin() -> None:
    builder = _stages()["builder"]
    args = dict(a.split("=", 1) for i, a in builder if i == "ARG" and "=" in a)
    assert args["LLAMA_CPP_PYTHON"] == llama_cpp_pin(), "keep the Dockerfile's pin equal to pyproject.toml's"
    llama = [n for n, (i, a) in enumerate(builder) if i == "RUN" and '"$LLAMA_CPP_PYTHON"' in a]
    project = [n for n, (i, a) in enumerate(builder) if i == "RUN" and re.search(r"pip install \.(\s|$)", a)]
    copy = [n for n, (i, a) in enumerate(builder) if i == "COPY"]
    assert len(llama) == 1 and len(project) == 1
    # The slow layer comes before the project's files are copied in, so code changes do not rebuild it.
    assert llama[0] < copy[0] < project[0]


def test_the_runtime_has_no_compiler_runs_unprivileged_and_holds_no_model() -> None:
    runtime = _stages()["runtime"]
    installs = " ".join(a for i, a in runtime if i == "RUN")
    assert "build-essential" not in installs and "cmake" not in installs
    user = [a for i, a in runtime if i == "USER"]
    assert len(user) == 1 and not user[0].startswith(("0", "root"))
    assert re.search(r"useradd [^&]*--uid " + user[0].split(":")[0], installs)
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert {"modelFiles", ".venv", ".git"} <= set(ignored), "no model, venv or history in the build context"


def test_the_default_command_and_ports_are_the_services() -> None:
    runtime = _stages()["runtime"]
    cmd = [a for i, a in runtime if i == "CMD"]
    assert cmd == ['["llm-coordinator"]'] and "llm-coordinator" in console_scripts()
    assert "llm-worker" in console_scripts()
    exposed = {int(p) for i, a in runtime if i == "EXPOSE" for p in a.split()}
    assert exposed == {default_port("coordinator"), default_port("worker")}
    env = " ".join(a for i, a in runtime if i == "ENV")
    values = dict(pair.split("=", 1) for pair in shlex.split(env) if "=" in pair)
    assert values["HOST"] == values["WORKER_HOST"] == "0.0.0.0"


def test_every_package_of_the_repository_is_installed_into_the_image() -> None:
    """The image installs the project non-editable (`pip install .`): a package that pyproject.toml's
    package list misses works in the editable .venv and is absent in the image. The benchmarks are
    left out on purpose: they run from a checkout, never from the image."""
    import fnmatch
    import tomllib

    with (ROOT / "pyproject.toml").open("rb") as handle:
        include = tomllib.load(handle)["tool"]["setuptools"]["packages"]["find"]["include"]
    packages = {p.parent.name for p in ROOT.glob("*/__init__.py")} - {"tests", "bench"}
    assert not any(fnmatch.fnmatch("bench", pattern) for pattern in include), "bench/ stays out of the wheel"
    missing = {p for p in packages if not any(fnmatch.fnmatch(p, pattern) for pattern in include)}
    assert not missing, f"add {sorted(missing)} to [tool.setuptools.packages.find] include"
