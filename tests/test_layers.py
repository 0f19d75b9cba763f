"""The layers contracts (pyproject.toml, `[tool.importlinter]`; docs/architecture.md, "Layers") cover
every room of both services: a room that no layer names would be free to import anything."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def rooms(package: str) -> set[str]:
    """Each subpackage and each module directly under `package`."""
    found = set()
    for path in (ROOT / package).iterdir():
        if path.is_dir() and (path / "__init__.py").exists():
            found.add(path.name)
        elif path.suffix == ".py" and path.name != "__init__.py":
            found.add(path.stem)
    return found


def layered(package: str) -> list[str]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    (contract,) = [c for c in config["contracts"] if c["type"] == "layers" and c["containers"] == [package]]
    return [name.strip() for layer in contract["layers"] for name in layer.replace(":", "|").split("|")]


@pytest.mark.parametrize("package", ["coordinator", "worker"])
def test_every_room_is_named_in_one_layer(package: str) -> None:
    names = layered(package)
    assert sorted(names) == sorted(set(names)), "a room named in two layers"
    assert set(names) == rooms(package)
