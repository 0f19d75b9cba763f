"""The shape of the code, held where lint-imports and ruff do not reach: the layers contracts
(pyproject.toml, `[tool.importlinter]`; docs/architecture.md, "Layers") cover every room of both
services (a room no layer names would be free to import anything), and no product function is above
cyclomatic complexity 15 (radon)."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest
from radon.complexity import cc_visit

ROOT = Path(__file__).resolve().parent.parent
PRODUCT = ("coordinator", "worker", "protocol", "serving", "client")
MAX_COMPLEXITY = 15


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


def test_no_product_function_is_above_complexity_15() -> None:
    over = [f"{path.relative_to(ROOT)}:{block.lineno} {block.fullname} ({block.complexity})"
            for package in PRODUCT for path in sorted((ROOT / package).rglob("*.py"))
            for block in cc_visit(path.read_text()) if block.complexity > MAX_COMPLEXITY]
    assert over == [], "split these (each name is a step of its own): " + ", ".join(over)
