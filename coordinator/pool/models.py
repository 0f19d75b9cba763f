"""Which served model a request means.

Owns: resolving a requested name or alias, the configured default, or the only model served.
Must not: hold state; the registry keeps the names (O(1) per lookup).
"""

from __future__ import annotations

from coordinator.errors import CoordinatorError
from coordinator.pool.registry import Registry
from protocol import reasons


def resolve_model(registry: Registry, default: str | None, requested: str | None) -> str | None:
    """The served model a request means, or a `CoordinatorError` (404 names the models served); None
    when nothing is served yet (admission then answers `no_workers`)."""
    if requested is None:
        if default:
            return registry.resolve(default) or default
        known = registry.known_models()
        if len(known) > 1:
            raise CoordinatorError(reasons.INVALID_REQUEST, f"model: required, this pool serves {', '.join(known)}")
        return known[0] if known else None
    model = registry.resolve(requested)
    if model is None:
        served = ", ".join(registry.known_models()) or "none"
        raise CoordinatorError(reasons.UNKNOWN_MODEL, f"no worker serves model {requested!r}; served: {served}")
    return model
