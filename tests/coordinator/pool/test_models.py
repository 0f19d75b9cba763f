"""resolve_model: names and aliases, no name, an unknown name refused, or taken with `any_name`; a model a
worker offers from its folder but none serves is 503 naming the workers that offer it."""

from __future__ import annotations

import pytest

from coordinator.errors import CoordinatorError
from coordinator.pool.models import resolve_model
from coordinator.pool.registry import Registry
from protocol import reasons
from protocol.health import OfferedModel
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


def offering(reg: Registry, worker_id: str, served: str, *offers: OfferedModel) -> None:
    reg.upsert(heartbeat(worker_id, timestamp=1, model=served).model_copy(update={"offered": list(offers)}), now=0.0)


def test_a_model_offered_but_served_by_none_is_503_naming_who_offers_it_never_the_default() -> None:
    reg = pool()
    gemma = OfferedModel(name="gemma", aliases=["gemma-3"], state="offered", need_bytes=1)
    offering(reg, "w1", "small", OfferedModel(name="small", state="loaded"), gemma,
             OfferedModel(name="broken", state="unavailable", reason="not a GGUF file"))
    offering(reg, "w2", "small", gemma)
    assert reg.offered_models() == {"gemma": ["w1", "w2"]}  # neither the served one nor the unavailable one
    for asked in ("gemma", "gemma-3"):
        with pytest.raises(CoordinatorError) as raised:
            resolve_model(reg, None, asked, any_name=True)
        assert raised.value.reason == reasons.MODEL_UNAVAILABLE and "'gemma' is offered by w1, w2" in str(raised.value)
    with pytest.raises(CoordinatorError) as unknown:
        resolve_model(reg, None, "broken")
    assert unknown.value.reason == reasons.UNKNOWN_MODEL
    # Once a worker serves it, it is served.
    offering(reg, "w3", "gemma")
    assert resolve_model(reg, None, "gemma") == "gemma" and reg.offered_models() == {}


def test_a_folders_name_for_a_model_served_elsewhere_is_that_model() -> None:
    """A file's stem names its model on every worker: `a-smol` (the folder worker's file, now swapped to
    another model) means the model a plain worker serves from a file of another name."""
    reg = pool("small")
    reg.upsert(heartbeat("folder", timestamp=1, model="large").model_copy(update={"offered": [
        OfferedModel(name="small", aliases=["a-smol"], state="offered"),
        OfferedModel(name="large", aliases=["b-large"], state="loaded")]}), now=0.0)
    assert resolve_model(reg, None, "a-smol") == "small" and resolve_model(reg, None, "b-large") == "large"
