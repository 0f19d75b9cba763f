"""scripts/mutations.py's own machinery, without running pytest: the table is not stale, a stale entry
is an error, and the tests it names exist. The mutations themselves run with the script."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parent.parent


def load_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("mutations", ROOT / "scripts" / "mutations.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


mutations = load_script()


@pytest.mark.parametrize("mutation", mutations.MUTATIONS, ids=[m.name for m in mutations.MUTATIONS])
def test_each_mutation_changes_its_file_once_and_names_tests_that_exist(mutation: object) -> None:
    m = mutation
    assert isinstance(m, mutations.Mutation)
    source = (ROOT / m.path).read_text()
    mutated = m.apply(source)  # raises when the table has gone stale
    assert mutated != source and m.old != m.new
    assert m.tests and all((ROOT / test.split("::")[0]).is_file() for test in m.tests)
    assert all(not test.startswith(m.path) for test in m.tests)


def test_names_are_unique_and_cover_the_claimed_properties() -> None:
    names = [m.name for m in mutations.MUTATIONS]
    assert len(names) == len(set(names)) >= 10
    assert {"admission-loops-alive", "admission-loops-all", "admission-loops-dict", "affinity-ignores-model"} <= set(names)


@pytest.mark.parametrize("source", ["nothing to see", "x = 1\nx = 1\n"], ids=["missing", "twice"])
def test_a_stale_entry_is_an_error_not_a_pass(source: str) -> None:
    m = mutations.Mutation("m", "a property", "f.py", "x = 1\n", "x = 2\n", ("tests/t.py",))
    with pytest.raises(mutations.StaleMutation, match="the table is stale"):
        m.apply(source)


def test_only_the_named_mutations_run_and_an_unknown_name_is_refused() -> None:
    assert [m.name for m in mutations.chosen(["queue-lifo"])] == ["queue-lifo"]
    assert len(mutations.chosen([])) == len(mutations.MUTATIONS)
    with pytest.raises(SystemExit, match="unknown mutation"):
        mutations.chosen(["no-such-mutation"])


def test_the_snapshot_holds_what_pytest_needs_and_no_copy_of_the_model_or_venv(tmp_path: Path) -> None:
    base = mutations.snapshot(tmp_path)
    present = {p.name for p in base.iterdir()}
    assert {"coordinator", "worker", "protocol", "tests", "pyproject.toml", "mutation_guard.py"} <= present
    assert not {".venv", ".git"} & present
    if "modelFiles" in present:  # the real-process tests' model: a link to the tree's, never a copy
        assert (base / "modelFiles").is_symlink()
    assert not list(base.rglob("__pycache__"))


@pytest.mark.parametrize(("output", "expected"), [
    ("..F\nFAILED tests/a.py::test_x - assert 1 == 2\n1 failed", "tests/a.py::test_x"),
    ("ERROR tests/b.py - ImportError\n", "tests/b.py"),
    ("1 passed", "?"),
])
def test_the_killing_test_is_read_from_pytests_summary(output: str, expected: str) -> None:
    assert mutations.first_failure(output) == expected
