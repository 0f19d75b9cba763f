"""Priority classes: which class a request asked for, and whether its key may ask for it.

Owns: the classes and their order (`interactive` above `batch`), reading a request's class from the
`X-Priority` header, /coordinator/infer's `priority` field or OpenAI's `service_tier` (`flex` is
batch, `priority` interactive, `auto` and `default` the key's default), and checking it against the
key's highest allowed class (`max_priority=` in the keys file; the default class is `priority=`).
Must not: order anything (queue.py puts higher classes first; within a class the fair order holds).
"""

from __future__ import annotations

from coordinator.errors import CoordinatorError
from protocol import reasons
from protocol.inference import PRIORITY_CLASSES as CLASSES  # lowest first: a class's rank is its index

BATCH, INTERACTIVE = CLASSES
HEADER = "x-priority"
SERVICE_TIERS = {"flex": BATCH, "priority": INTERACTIVE, "default": "", "auto": ""}


def asked(header: str | None, body: str | None = None, *, param: str = "priority") -> str:
    """The class a request names ("" for its key's default), from its header and its body's field;
    400 naming an unknown class, or two that disagree."""
    named = [v.strip().lower() for v in (header, body) if v is not None and v.strip()]
    for value in named:
        if value not in CLASSES:
            raise CoordinatorError(reasons.INVALID_REQUEST, f"{param}: {value!r} is not a priority class "
                                   f"(one of {', '.join(reversed(CLASSES))})", param=param)
    if len(set(named)) > 1:
        raise CoordinatorError(reasons.INVALID_REQUEST, f"{param}: the {HEADER} header says {named[0]!r} and the "
                               f"body {named[1]!r}", param=param)
    return named[0] if named else ""


def rank(name: str) -> int:
    return CLASSES.index(name)


def resolve(asked: str, default: str, highest: str) -> int:
    """The rank a request runs at: the class it asked for, or its key's default; 400 when it asked for
    a class above the key's highest."""
    name = asked or default
    if rank(name) > rank(highest):
        raise CoordinatorError(reasons.INVALID_REQUEST, f"priority: {name!r} is above this key's highest class "
                               f"{highest!r}", param="priority")
    return rank(name)
