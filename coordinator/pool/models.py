"""Which served model a request means.

Owns: resolving a requested name or alias, the configured default, or the only model served (also for
a name no worker serves, when the pool is set to take any name, as llama-server does); the refusal of
a model some worker offers from its folder but none serves.
Must not: hold state; the registry keeps the names (O(1) per lookup).
"""

from __future__ import annotations

from coordinator.errors import CoordinatorError
from coordinator.pool.registry import Registry
from protocol import reasons


def resolve_model(registry: Registry, default: str | None, requested: str | None, *,
                  any_name: bool = False) -> str | None:
    """The served model a request means, or a `CoordinatorError` (404 names the models served); None
    when nothing is served yet (admission then answers `no_workers`). `any_name`: a name no worker
    serves means what no name means (the default, or the only model), when there is one."""
    model = None if requested is None else registry.resolve(requested)
    if model is not None:
        return model
    if requested is not None:
        _offered(registry, requested)
        if (named := registry.offer_named(requested)) is not None and registry.knows_model(named):
            return named  # a folder's name for a model served (by another file's worker, say)
    if requested is None or (any_name and (default or len(registry.known_models()) == 1)):
        if default:
            return registry.resolve(default) or default
        known = registry.known_models()
        if len(known) > 1:
            raise CoordinatorError(reasons.INVALID_REQUEST, f"model: required, this pool serves {', '.join(known)}")
        return known[0] if known else None
    served = ", ".join(registry.known_models()) or "none"
    raise CoordinatorError(reasons.UNKNOWN_MODEL, f"no worker serves model {requested!r}; served: {served}")


def _offered(registry: Registry, requested: str) -> None:
    """503 `model_unavailable` for a model a worker offers from its folder but none serves."""
    offered = registry.offered_as(requested)
    if offered is not None:
        workers = ", ".join(registry.offered_models().get(offered, []))
        raise CoordinatorError(reasons.MODEL_UNAVAILABLE, f"model {offered!r} is offered by {workers} but served by "
                               "no worker now (a chat or completion request for it has it loaded, unless "
                               "MODEL_LOADS is off)", param="model")


def stand_in(registry: Registry, requested: str | None, model: str | None) -> str | None:
    """The served name to send workers in place of `requested` when it names nothing served (a name
    taken with `any_name`: a worker checks the name itself); None: send the request as it came."""
    if requested is None or model is None or registry.resolve(requested) is not None:
        return None
    return model
