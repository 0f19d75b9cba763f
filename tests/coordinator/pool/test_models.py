"""resolve_model: names and aliases, no name, an unknown name refused, or taken with `any_name`."""

from __future__ import annotations

import pytest

from coordinator.errors import CoordinatorError
from coordinator.pool.models import resolve_model
from coordinator.pool.registry import Registry
from protocol import reasons
from tests.coordinator.fakes import heartbeat


def pool(*models: str) -> Registry:
    reg = Registry(stale_after=3.0, dead_after=6.0)
    for i, model in enumerate(models):
        reg.upsert(heartbeat(f"w{i}", timestamp=1, model=model, aliases=(f"{model}-alias",)), now=0.0)
    return reg


def test_a_name_or_an_alias_is_the_model_it_names() -> None:
    reg = pool("small", "large")
    assert resolve_model(reg, None, "large") == "large"
    assert resolve_model(reg, None, "small-alias") == "small"
    assert resolve_model(reg, "small", "large", any_name=True) == "large"


def test_no_name_is_the_default_or_the_only_model() -> None:
    assert resolve_model(pool("small"), None, None) == "small"
    assert resolve_model(pool("small", "large"), "large", None) == "large"
    assert resolve_model(pool(), None, None) is None
    with pytest.raises(CoordinatorError) as raised:
        resolve_model(pool("small", "large"), None, None)
    assert raised.value.reason == reasons.INVALID_REQUEST


def test_an_unknown_name_is_404_naming_the_models_served() -> None:
    with pytest.raises(CoordinatorError) as raised:
        resolve_model(pool("small"), None, "gpt-3.5-turbo")
    assert raised.value.reason == reasons.UNKNOWN_MODEL
    assert "small" in str(raised.value)


def test_any_name_takes_an_unknown_name_as_no_name() -> None:
    assert resolve_model(pool("small"), None, "gpt-3.5-turbo", any_name=True) == "small"
    assert resolve_model(pool("small", "large"), "large", "org/any:Q8_0", any_name=True) == "large"


def test_any_name_still_refuses_where_no_name_would_be_ambiguous() -> None:
    with pytest.raises(CoordinatorError) as raised:
        resolve_model(pool("small", "large"), None, "gpt-3.5-turbo", any_name=True)
    assert raised.value.reason == reasons.UNKNOWN_MODEL
