"""A worker's folder of models (`--model-dir`, issue 37): what it offers, which one it serves at start,
and the offers as its heartbeats list them.

Owns: the memory budget (`WORKER_MODEL_MEMORY`, or the machine's memory less a margin), the sizing the
catalog judges each file by (this worker's sessions and context), choosing the model to serve when
`--model` does not name one (the first offered, in name order), `rescan` (the folder read again, a
file's header and digest only when it changed), and `listed`, the heartbeat's view.
Must not: read a file's header (catalog.py does) or load weights (the runtime does).
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Collection, Sequence
from pathlib import Path

from protocol.health import MAX_OFFER_REASON, OfferedModel
from protocol.worker import MODEL_NAME_PATTERN
from worker.models.catalog import MAX_FILES, Offer, Sizing, scan
from worker.naming import ModelNames, derive_name
from worker.settings import WorkerSettings

log = logging.getLogger("worker.models")
MARGIN_BYTES = 1 << 30  # at least this much of the machine's memory is left to everything else
MAX_LISTED_ALIASES = 4  # OfferedModel.aliases


class FolderError(ValueError):
    """The folder offers nothing this worker could serve (each file's reason named)."""


def machine_memory() -> int:
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def budget_bytes(settings: WorkerSettings, total: int | None = None) -> int:
    """What the folder's models may take: `model_memory`, else `total` (the machine's memory) less the
    larger of MARGIN_BYTES and a tenth of it."""
    if settings.model_memory:
        return settings.model_memory
    total = machine_memory() if total is None else total
    return max(0, total - max(MARGIN_BYTES, total // 10))


def sizing(settings: WorkerSettings) -> Sizing:
    """Each model as this worker would load it: its sessions sharing its whole context."""
    return Sizing(sessions=settings.max_sessions, session_tokens=settings.ctx_size // settings.max_sessions,
                  budget_bytes=budget_bytes(settings))


def open_folder(settings: WorkerSettings) -> tuple[WorkerSettings, list[Offer]]:
    """The folder's offers, and the settings to start with: as given when `--model` names a file, else
    serving the first model offered (`FolderError` when there is none)."""
    folder = settings.model_dir
    if folder is None:
        return settings, []
    if not folder.is_dir():
        raise FolderError(f"model_dir {folder} is not a folder")
    offers = scan(folder, sizing(settings))
    more = len(list(folder.glob("*.gguf"))) - len(offers)
    if more > 0:
        log.warning("model_dir %s: %d GGUF files past the first %d are not offered", folder, more, MAX_FILES)
    for o in offers:
        if o.state != "offered":
            log.warning("model_dir %s: %s is %s: %s", folder, o.path.name, o.state, o.reason)
    if "model_path" in settings.model_fields_set:
        return settings, offers
    first = next((o for o in offers if o.state == "offered"), None)
    if first is None:
        why = "; ".join(f"{o.path.name}: {o.reason}" for o in offers[:4]) or "no *.gguf files"
        raise FolderError(f"no model in {folder} can be served ({why})")
    return settings.model_copy(update={"model_path": first.path}), offers


def rescan(settings: WorkerSettings, judged: dict[Path, Offer]) -> list[Offer]:
    """The folder's offers now: `scan`, keeping the verdict of a file unchanged since the last read
    (`judged`, which it updates). A folder that is gone offers nothing."""
    folder = settings.model_dir
    if folder is None or not folder.is_dir():
        judged.clear()
        return []
    return scan(folder, sizing(settings), judged)


def listed(offers: Sequence[Offer], serving: Path | None, names: ModelNames,
           beside: Collection[Path] = ()) -> list[OfferedModel]:
    """The offers as a heartbeat lists them: the file this worker serves as `loaded`, under the names it
    serves it by (`serving` None: none loaded, the worker's model unloaded); those whose path is in
    `beside` as loading beside the models served (worker/slots/swapper.py)."""
    out = []
    exact = any(o.path == serving for o in offers)  # else the file given by another path (--model)
    for o in offers:
        loaded = serving is not None and o.state == "offered" and (
            o.path == serving if exact else _same_file(o.path, serving))
        shown = names if loaded else o.names or ModelNames(derive_name(None, o.path.stem))
        # A file's stem is an alias only where it is a name a request can use (no spaces, say).
        aliases = [a for a in shown.aliases if re.fullmatch(MODEL_NAME_PATTERN, a)][:MAX_LISTED_ALIASES]
        out.append(OfferedModel(name=shown.name, aliases=aliases,
                                identity=o.identity, state="loaded" if loaded else o.state,
                                need_bytes=o.need_bytes, reason=o.reason[:MAX_OFFER_REASON],
                                beside=not loaded and o.state == "offered" and o.path in beside))
    return out


def _same_file(a: Path, b: Path) -> bool:
    try:
        return a.samefile(b)
    except OSError:
        return False
