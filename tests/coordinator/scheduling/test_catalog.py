"""Plugins by name: each filter, scorer and picker registers itself in its own module, and the catalog
finds it there; the policy and the settings' choices read the catalog."""

from __future__ import annotations

import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
from pydantic import ValidationError

from coordinator.scheduling import catalog
from coordinator.scheduling.plugin import EMBEDDINGS, GENERATION
from coordinator.scheduling.policy import Policy
from coordinator.settings import Settings


@pytest.fixture
def package(tmp_path: Path) -> Iterator[Path]:
    """An importable package of plugins, written by the test."""
    root = tmp_path / "extra_pickers"
    root.mkdir()
    (root / "__init__.py").write_text("")
    sys.path.insert(0, str(tmp_path))
    yield root
    sys.path.remove(str(tmp_path))
    for name in [m for m in sys.modules if m.startswith("extra_pickers")]:
        del sys.modules[name]


def plugin_module(name: str) -> str:
    return textwrap.dedent(f"""
        from coordinator.scheduling.pickers.score import ByScore
        from coordinator.scheduling.plugin import Plugin
        PLUGIN = Plugin({name!r}, lambda options: ByScore())
    """)


def test_a_module_that_defines_a_plugin_is_found_by_its_name_and_one_without_is_not(package: Path) -> None:
    (package / "mine.py").write_text(plugin_module("mine"))
    (package / "helper.py").write_text("VALUE = 1\n")
    assert list(catalog._found("extra_pickers")) == ["mine"]


def test_two_plugins_of_one_name_are_refused(package: Path) -> None:
    (package / "a.py").write_text(plugin_module("twice"))
    (package / "b.py").write_text(plugin_module("twice"))
    with pytest.raises(RuntimeError, match="twice"):
        catalog._found("extra_pickers")


def test_the_built_in_plugins_and_the_order_each_policy_runs_its_filters_in() -> None:
    assert set(catalog.pickers()) >= {"score", "round-robin", "least-connections", "random", "least-latency"}
    assert catalog.named(GENERATION, catalog.filters()) == [
        "alive", "serves_model", "not_draining", "breaker_closed", "session_room", "kv_room"]
    assert catalog.named(EMBEDDINGS, catalog.filters()) == [
        "alive", "serves_model", "serves_embeddings", "not_draining", "breaker_closed", "embedding_room"]
    assert catalog.named(GENERATION, catalog.scorers()) == ["kv_load", "prefix", "session_load"]
    policy = Policy.build_embeddings(stale_after=3.0)
    assert [s.name for s, _ in policy.scorers] == ["embedding_load", "session_load"]


def test_settings_take_the_names_the_catalog_has_and_say_which_those_are() -> None:
    for name in catalog.pickers():
        assert Settings(routing_policy=name).routing_policy == name
    with pytest.raises(ValidationError, match="least-latency"):
        Settings(routing_policy="fastest")
    with pytest.raises(ValidationError, match="embedding_load"):  # not a generation scorer
        Settings(scorers="embedding_load:1")
    assert "least-connections" in Settings.model_fields["routing_policy"].description  # type: ignore[operator]
