"""`discover`: the plugins a package's modules define, by name; a second of one name is refused."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from serving.plugins import discover


@dataclass(frozen=True)
class Thing:
    name: str


def package(tmp_path: Path, modules: dict[str, str]) -> str:
    root = tmp_path / "things_pkg"
    root.mkdir()
    (root / "__init__.py").write_text("")
    for module, body in modules.items():
        (root / f"{module}.py").write_text(body)
    sys.path.insert(0, str(tmp_path))
    return "things_pkg"


@pytest.fixture(autouse=True)
def _forget() -> object:
    yield
    for name in [n for n in sys.modules if n.startswith("things_pkg")]:
        del sys.modules[name]


def test_found_by_name_in_module_order_and_others_skipped(tmp_path: Path) -> None:
    made = "from tests.serving.test_plugins import Thing\nPLUGIN = Thing({!r})\n"
    name = package(tmp_path, {"b": made.format("beta"), "a": made.format("alpha"), "c": "PLUGIN = 'not a Thing'\n",
                              "d": "OTHER = 1\n"})
    try:
        found = discover(name, "PLUGIN", Thing, "things")
    finally:
        sys.path.remove(str(tmp_path))
    assert list(found) == ["alpha", "beta"] and found["beta"] == Thing("beta")
    with pytest.raises(TypeError):
        found["gamma"] = Thing("gamma")  # type: ignore[index]  # read-only


def test_two_of_one_name_are_refused(tmp_path: Path) -> None:
    made = "from tests.serving.test_plugins import Thing\nPLUGIN = Thing('same')\n"
    name = package(tmp_path, {"a": made, "b": made})
    try:
        with pytest.raises(RuntimeError, match="two things are named 'same'"):
            discover(name, "PLUGIN", Thing, "things")
    finally:
        sys.path.remove(str(tmp_path))
