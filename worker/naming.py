"""The public name a worker serves its model under, and the aliases it also answers to.

Owns: the rule that derives a default name from the GGUF's own metadata, and the set of names a
request's `model` may use on this worker.
Must not: read files or settings itself; the runtime passes in what the model and settings say.

The rule (README, "Model names"): take `general.name` from the GGUF (the file's stem when it has
none), lower-case it, turn every run of characters other than `a-z 0-9 . _ -` into one `-`, and trim
`-`, `.` and `_` from both ends. So "SmolLM2 135M Instruct" serves as `smollm2-135m-instruct`. The
file's stem (e.g. `SmolLM2-135M-Instruct.Q4_1`) is always an alias, so the name a pool used before
names existed keeps working.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_NOT_NAME = re.compile(r"[^a-z0-9._\-]+")
MAX_NAME = 128


def derive_name(general_name: str | None, file_stem: str) -> str:
    text = (general_name or "").strip() or file_stem
    name = _NOT_NAME.sub("-", text.lower()).strip("-._")[:MAX_NAME].strip("-._")
    return name or "model"


@dataclass(frozen=True)
class ModelNames:
    name: str
    aliases: tuple[str, ...] = ()

    @classmethod
    def choose(cls, *, configured: str, configured_aliases: tuple[str, ...], general_name: str | None,
               file_stem: str) -> ModelNames:
        name = configured or derive_name(general_name, file_stem)
        aliases = [a for a in (*configured_aliases, file_stem) if a and a != name]
        return cls(name, tuple(dict.fromkeys(aliases)))

    def serves(self, requested: str) -> bool:
        return requested == self.name or requested in self.aliases
