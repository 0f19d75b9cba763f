"""Plugins found by name in the package that holds them: the coordinator's scheduling plugins and the
worker's engine backends are each registered in the module that defines them, and found here.

Owns: `discover`: every module of a package that defines the named attribute as an instance of the
plugin type, by its `name`, read-only; two of one name are refused.
Must not: know any plugin or either service.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Mapping
from types import MappingProxyType
from typing import Protocol, TypeVar


class Named(Protocol):
    @property
    def name(self) -> str: ...


T = TypeVar("T", bound=Named)


def discover(package: str, attribute: str, kind: type[T], what: str) -> Mapping[str, T]:
    """The `kind` instances that the modules of `package` hold as `attribute`, by name, in module name
    order (modules without one are skipped); `what` names the plugins in the refusal of a duplicate."""
    found: dict[str, T] = {}
    for info in sorted(pkgutil.iter_modules(importlib.import_module(package).__path__), key=lambda i: i.name):
        plugin = getattr(importlib.import_module(f"{package}.{info.name}"), attribute, None)
        if not isinstance(plugin, kind):
            continue
        if plugin.name in found:
            raise RuntimeError(f"two {what} are named {plugin.name!r}")
        found[plugin.name] = plugin
    return MappingProxyType(found)
