"""docs/architecture.md's rooms tables stay complete: every module of the coordinator and of the worker
is named in its service's table, and every name there is a module or a folder that exists.

The rule, for a module `<package>/<path>.py` (every `.py` file but `__init__.py`, at any depth): the
"modules" column of `<package>`'s rooms table names it by `<path>` (`pool/models`, `state`), or, in a row
whose room is a folder (`admission/`), by its path under that folder (`fairness`); a folder written with
its slash (`filters/`) names every module under it. A new module is one more name in its room's row."""

from __future__ import annotations

import itertools
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent.parent
DOC = ROOT / "docs" / "architecture.md"
HEADINGS = {"coordinator": "## The coordinator's rooms", "worker": "### The worker's rooms"}

pytestmark = pytest.mark.unit


def modules(package: str) -> set[str]:
    """Each module of `package` by its path under it, without `.py`."""
    base = ROOT / package
    return {path.relative_to(base).with_suffix("").as_posix() for path in base.rglob("*.py")
            if path.name != "__init__.py"}


def _table(text: str, heading: str) -> list[list[str]]:
    """The cells of the first table after `heading`, its head and rule left out."""
    lines = text[text.index(heading):].splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("|"))
    rows = list(itertools.takewhile(lambda line: line.startswith("|"), lines[start:]))
    return [[cell.strip() for cell in row.strip("|").split("|")] for row in rows[2:]]


def named(package: str, text: str | None = None) -> set[str]:
    """Every name the modules column of `package`'s table gives, as a path under `package`."""
    names = set()
    for room, *_, listed in _table(DOC.read_text() if text is None else text, HEADINGS[package]):
        rooms = re.findall(r"`([^`]+)`", room)
        folder = rooms[0] if len(rooms) == 1 and rooms[0].endswith("/") else ""
        names |= {folder + name for name in re.findall(r"`([^`]+)`", listed)}
    return names


def covered(module: str, names: set[str]) -> bool:
    parts = module.split("/")
    return module in names or any("/".join(parts[:n]) + "/" in names for n in range(1, len(parts)))


@pytest.mark.parametrize("package", sorted(HEADINGS))
def test_every_module_is_named_in_its_rooms_table(package: str) -> None:
    names = named(package)
    missing = sorted(m for m in modules(package) if not covered(m, names))
    assert not missing, (f"docs/architecture.md, {HEADINGS[package].lstrip('# ')!r}: name these {package} "
                         f"modules in their room's row: {', '.join(missing)}")


@pytest.mark.parametrize("package", sorted(HEADINGS))
def test_every_name_in_the_table_exists(package: str) -> None:
    gone = sorted(name for name in named(package) if not (
        (ROOT / package / name).is_dir() if name.endswith("/") else (ROOT / package / f"{name}.py").exists()))
    assert not gone, (f"docs/architecture.md, {HEADINGS[package].lstrip('# ')!r} names what {package}/ lacks: "
                      f"{', '.join(gone)}")


def test_a_module_left_out_is_found() -> None:
    """The check is not vacuous: a name taken out of a row is reported."""
    text = DOC.read_text()
    row = next(line for line in text.splitlines() if line.startswith("| `admission/`"))
    assert covered("admission/queue", named("coordinator", text))
    assert not covered("admission/queue", named("coordinator", text.replace(row, row.replace("`queue`", ""))))
    assert covered("scheduling/filters/alive", {"scheduling/filters/"})
