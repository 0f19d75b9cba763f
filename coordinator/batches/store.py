"""The batch store: files, batches and each batch's lines, in an embedded SQLite database, with the
files' bytes on disk beside it (`BATCH_DIR`).

Owns: the schema; the bounds on what a tenant keeps (a file's bytes and lines, files and bytes per
tenant, a retention time after which files and finished batches are removed), each refused with the
bound named; tenancy (every read and change names the tenant, and another tenant's rows are not found);
each line's result recorded in the same transaction that marks it done, so a line is in the output
once whatever restarts; and the lease by which one runner at a time runs a job (`claim`, `renew`): a
runner that stops renewing loses the job to the next `claim` once its lease has run out, and its late
results are refused (`record` checks the owner in the same transaction).
Must not: run lines (runner.py) or know their shapes (lines.py): a result is stored as the text given.

Every method is blocking: callers run them in the store's one thread (`call`), which also orders them.
Several coordinators share jobs by sharing the directory (a volume every coordinator mounts); SQLite's
own locking orders their transactions (`BEGIN IMMEDIATE`, a busy timeout).
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import sqlite3
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ParamSpec, TypeVar

from coordinator.batches.lines import Line, Refused, count
from coordinator.errors import CoordinatorError
from protocol import batches as wire
from protocol import reasons

P = ParamSpec("P")
T = TypeVar("T")
BUSY_TIMEOUT = 10.0  # seconds a transaction waits for another coordinator's to end

SCHEMA = """
CREATE TABLE IF NOT EXISTS files (
    id TEXT PRIMARY KEY, tenant TEXT NOT NULL, purpose TEXT NOT NULL, filename TEXT NOT NULL,
    bytes INTEGER NOT NULL, created_at INTEGER NOT NULL, expires_at INTEGER NOT NULL);
CREATE INDEX IF NOT EXISTS files_by_tenant ON files (tenant, created_at);
CREATE TABLE IF NOT EXISTS batches (
    id TEXT PRIMARY KEY, tenant TEXT NOT NULL, key_id TEXT, endpoint TEXT NOT NULL, input_file_id TEXT NOT NULL,
    status TEXT NOT NULL, created_at INTEGER NOT NULL, expires_at INTEGER NOT NULL, in_progress_at INTEGER,
    finalizing_at INTEGER, completed_at INTEGER, failed_at INTEGER, expired_at INTEGER, cancelling_at INTEGER,
    cancelled_at INTEGER, output_file_id TEXT, error_file_id TEXT, metadata TEXT, errors TEXT,
    total INTEGER NOT NULL DEFAULT 0, completed INTEGER NOT NULL DEFAULT 0, failed INTEGER NOT NULL DEFAULT 0,
    owner TEXT, lease_until REAL NOT NULL DEFAULT 0);
CREATE INDEX IF NOT EXISTS batches_by_tenant ON batches (tenant, created_at);
CREATE TABLE IF NOT EXISTS lines (
    batch_id TEXT NOT NULL, idx INTEGER NOT NULL, custom_id TEXT, body BLOB, done INTEGER NOT NULL DEFAULT 0,
    failed INTEGER NOT NULL DEFAULT 0, result TEXT, PRIMARY KEY (batch_id, idx));
"""
_TIMES = ("in_progress_at", "finalizing_at", "completed_at", "failed_at", "expired_at", "cancelling_at",
          "cancelled_at")
# The moment each status is entered, in its batch's row.
ENTERED = {wire.IN_PROGRESS: "in_progress_at", wire.FINALIZING: "finalizing_at", wire.COMPLETED: "completed_at",
           wire.FAILED: "failed_at", wire.EXPIRED: "expired_at", wire.CANCELLING: "cancelling_at",
           wire.CANCELLED: "cancelled_at"}


@dataclass(frozen=True, slots=True)
class Bounds:
    file_bytes: int
    file_lines: int
    tenant_files: int
    tenant_bytes: int
    retention: int  # seconds a file (and a finished batch) is kept


@dataclass(frozen=True, slots=True)
class BatchRow:
    """A batch as stored, with who created it (`key_id`) for the runner to admit its lines as them."""

    batch: wire.Batch
    tenant: str
    key_id: str | None


class Store:
    def __init__(self, directory: Path, bounds: Bounds) -> None:
        self.bounds = bounds
        self._files = directory / "files"
        self._files.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(directory / "batches.sqlite3", timeout=BUSY_TIMEOUT, isolation_level=None,
                                   check_same_thread=False)
        self._db.row_factory = sqlite3.Row
        self._db.execute("PRAGMA journal_mode=WAL")
        # A commit is durable across a crash of the process without an fsync each (WAL): a power cut may
        # lose the last lines recorded, which then run again, once.
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(SCHEMA)
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="batch-store")

    async def call(self, method: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """`method` of this store, run in its thread."""
        return await asyncio.get_running_loop().run_in_executor(self._thread, lambda: method(*args, **kwargs))

    def close(self) -> None:
        self._thread.shutdown(wait=True)
        self._db.close()

    @contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        self._db.execute("BEGIN IMMEDIATE")
        try:
            yield self._db
        except BaseException:
            self._db.execute("ROLLBACK")
            raise
        self._db.execute("COMMIT")

    # Files

    def add_file(self, tenant: str, filename: str, purpose: str, data: bytes, now: int) -> wire.FileObject:
        """Keep an uploaded file, or refuse it (400, 413) naming the bound it would pass."""
        bounds = self.bounds
        if len(data) > bounds.file_bytes:
            raise _bound(f"the file's {len(data)} bytes are more than BATCH_FILE_MAX_BYTES ({bounds.file_bytes})", 413)
        lines = count(data)
        if lines > bounds.file_lines:
            raise _bound(f"the file's {lines} lines are more than BATCH_FILE_MAX_LINES ({bounds.file_lines})")
        if lines == 0:
            raise CoordinatorError(reasons.INVALID_REQUEST, "file: no line in it", param="file")
        with self._transaction() as db:
            files, held = db.execute("SELECT COUNT(*), COALESCE(SUM(bytes), 0) FROM files WHERE tenant = ?",
                                     (tenant,)).fetchone()
            if files >= bounds.tenant_files:
                raise _bound(f"this key's tenant keeps {files} files, BATCH_TENANT_MAX_FILES; delete one first")
            if held + len(data) > bounds.tenant_bytes:
                raise _bound(f"this key's tenant keeps {held} bytes of files; with this one's {len(data)} it would pass "
                             f"BATCH_TENANT_MAX_BYTES ({bounds.tenant_bytes}); delete some first", 413)
            return self._insert_file(db, tenant, filename, purpose, data, now)

    def _insert_file(self, db: sqlite3.Connection, tenant: str, filename: str, purpose: str, data: bytes,
                     now: int) -> wire.FileObject:
        file_id = "file-" + secrets.token_hex(12)
        temporary = self._files / (file_id + ".part")
        temporary.write_bytes(data)
        os.replace(temporary, self._files / file_id)
        expires = now + self.bounds.retention
        db.execute("INSERT INTO files VALUES (?, ?, ?, ?, ?, ?, ?)",
                   (file_id, tenant, purpose, filename, len(data), now, expires))
        return wire.FileObject(id=file_id, bytes=len(data), created_at=now, expires_at=expires, filename=filename,
                               purpose=purpose)

    def file(self, tenant: str, file_id: str) -> wire.FileObject | None:
        row = self._db.execute("SELECT * FROM files WHERE id = ? AND tenant = ?", (file_id, tenant)).fetchone()
        return _file(row) if row is not None else None

    def files(self, tenant: str, purpose: str | None, after: str | None, limit: int) -> wire.FileList:
        """The tenant's files, newest first, `limit` after the file `after`."""
        query, args = "SELECT * FROM files WHERE tenant = ?", [tenant]
        if purpose:
            query, args = query + " AND purpose = ?", [*args, purpose]
        rows = self._paged("files", query, args, tenant, after, limit)
        data = [_file(row) for row in rows[:limit]]
        return wire.FileList(data=data, first_id=data[0].id if data else None,
                             last_id=data[-1].id if data else None, has_more=len(rows) > limit)

    def _paged(self, table: str, query: str, args: list[Any], tenant: str, after: str | None,
               limit: int) -> list[sqlite3.Row]:
        if after:
            mark = self._db.execute(f"SELECT created_at, id FROM {table} WHERE id = ? AND tenant = ?",
                                    (after, tenant)).fetchone()
            if mark is not None:
                query, args = query + " AND (created_at, id) < (?, ?)", [*args, mark[0], mark[1]]
        return self._db.execute(query + " ORDER BY created_at DESC, id DESC LIMIT ?", [*args, limit + 1]).fetchall()

    def content(self, tenant: str, file_id: str) -> bytes | None:
        if self.file(tenant, file_id) is None:
            return None
        return (self._files / file_id).read_bytes()

    def delete_file(self, tenant: str, file_id: str) -> bool:
        with self._transaction() as db:
            gone = db.execute("DELETE FROM files WHERE id = ? AND tenant = ?", (file_id, tenant)).rowcount
        if gone:
            (self._files / file_id).unlink(missing_ok=True)
        return bool(gone)

    # Batches

    def create_batch(self, tenant: str, key_id: str | None, body: wire.BatchCreate, now: int,
                     window: int) -> wire.Batch:
        """A new batch in `validating`; 404 when the input file is not the tenant's, 400 when it is not a
        batch input."""
        found = self.file(tenant, body.input_file_id)
        if found is None:
            raise not_found("file", body.input_file_id, "input_file_id")
        if found.purpose != wire.BATCH:
            raise CoordinatorError(reasons.INVALID_REQUEST, f"input_file_id: {found.id} was uploaded with purpose "
                                   f"{found.purpose!r}, not 'batch'", param="input_file_id")
        batch_id = "batch_" + secrets.token_hex(12)
        metadata = json.dumps(body.metadata) if body.metadata is not None else None
        with self._transaction() as db:
            db.execute("INSERT INTO batches (id, tenant, key_id, endpoint, input_file_id, status, created_at, expires_at,"
                       " metadata) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                       (batch_id, tenant, key_id, body.endpoint, body.input_file_id, wire.VALIDATING, now,
                        now + window, metadata))
        row = self.batch(tenant, batch_id)
        assert row is not None
        return row

    def batch(self, tenant: str, batch_id: str) -> wire.Batch | None:
        row = self._db.execute("SELECT * FROM batches WHERE id = ? AND tenant = ?", (batch_id, tenant)).fetchone()
        return _batch(row) if row is not None else None

    def batches(self, tenant: str, after: str | None, limit: int) -> wire.BatchList:
        rows = self._paged("batches", "SELECT * FROM batches WHERE tenant = ?", [tenant], tenant, after, limit)
        data = [_batch(row) for row in rows[:limit]]
        return wire.BatchList(data=data, first_id=data[0].id if data else None,
                              last_id=data[-1].id if data else None, has_more=len(rows) > limit)

    def cancel(self, tenant: str, batch_id: str, now: int) -> wire.Batch | None:
        """Ask its runner to stop (`cancelling`); a batch already ended stays as it is."""
        with self._transaction() as db:
            db.execute("UPDATE batches SET status = ?, cancelling_at = ? WHERE id = ? AND tenant = ? "
                       "AND status IN (?, ?)", (wire.CANCELLING, now, batch_id, tenant, wire.VALIDATING,
                                                wire.IN_PROGRESS))
        return self.batch(tenant, batch_id)

    # The runner's side

    def claim(self, owner: str, now: float, lease: float, limit: int) -> list[BatchRow]:
        """Up to `limit` running batches no live lease holds (or `owner`'s own), now `owner`'s until `now + lease`."""
        placeholders = ", ".join("?" * len(wire.RUNNING))
        with self._transaction() as db:
            ids = [row[0] for row in db.execute(
                f"SELECT id FROM batches WHERE status IN ({placeholders}) AND (owner IS NULL OR owner = ? "
                "OR lease_until < ?) ORDER BY created_at LIMIT ?", (*wire.RUNNING, owner, now, limit))]
            db.executemany("UPDATE batches SET owner = ?, lease_until = ? WHERE id = ?",
                           [(owner, now + lease, batch_id) for batch_id in ids])
            rows = [db.execute("SELECT * FROM batches WHERE id = ?", (batch_id,)).fetchone() for batch_id in ids]
        return [BatchRow(_batch(row), row["tenant"], row["key_id"]) for row in rows]

    def renew(self, batch_id: str, owner: str, now: float, lease: float) -> wire.Batch | None:
        """The batch as it is now, its lease extended; None when another runner has taken it over."""
        with self._transaction() as db:
            held = db.execute("UPDATE batches SET lease_until = ? WHERE id = ? AND owner = ?",
                              (now + lease, batch_id, owner)).rowcount
            row = db.execute("SELECT * FROM batches WHERE id = ?", (batch_id,)).fetchone()
        return _batch(row) if held else None

    def release(self, batch_id: str, owner: str) -> None:
        """Give the job up (this coordinator stops): another may claim it at once."""
        with self._transaction() as db:
            db.execute("UPDATE batches SET owner = NULL, lease_until = 0 WHERE id = ? AND owner = ?",
                       (batch_id, owner))

    def load(self, batch_id: str, owner: str, items: list[Line | Refused], refusals: list[str], now: int) -> bool:
        """The input's lines, `refusals` the error-file lines of its `Refused` ones (done at once), and
        the batch `in_progress` (unless it is being cancelled). False: not this owner's any more."""
        with self._transaction() as db:
            if not self._owns(db, batch_id, owner):
                return False
            results = iter(refusals)
            db.executemany("INSERT OR IGNORE INTO lines VALUES (?, ?, ?, ?, ?, ?, ?)", [
                (batch_id, item.index, item.custom_id, item.body, 0, 0, None) if isinstance(item, Line)
                else (batch_id, item.index, item.custom_id, None, 1, 1, next(results)) for item in items])
            failed = len(refusals)
            db.execute("UPDATE batches SET total = ?, failed = ?, status = CASE status WHEN ? THEN ? ELSE status END,"
                       " in_progress_at = ? WHERE id = ?",
                       (len(items), failed, wire.VALIDATING, wire.IN_PROGRESS, now, batch_id))
        return True

    def pending(self, batch_id: str, after: int, limit: int) -> list[Line]:
        """Lines not yet done, in order, from the first after line `after`."""
        rows = self._db.execute("SELECT idx, custom_id, body FROM lines WHERE batch_id = ? AND done = 0 AND idx > ? "
                                "ORDER BY idx LIMIT ?", (batch_id, after, limit)).fetchall()
        return [Line(row[0], row[1], row[2]) for row in rows]

    def undone(self, batch_id: str) -> list[tuple[int, str | None]]:
        return [(row[0], row[1]) for row in self._db.execute(
            "SELECT idx, custom_id FROM lines WHERE batch_id = ? AND done = 0 ORDER BY idx", (batch_id,))]

    def record(self, batch_id: str, owner: str, index: int, result: str, *, failed: bool) -> bool:
        """Line `index` done with `result`, and the batch's counts, in one transaction. False when it was
        already done or the job is no longer `owner`'s: nothing is written then."""
        with self._transaction() as db:
            if not self._owns(db, batch_id, owner):
                return False
            done = db.execute("UPDATE lines SET done = 1, failed = ?, result = ? WHERE batch_id = ? AND idx = ? "
                              "AND done = 0", (int(failed), result, batch_id, index)).rowcount
            if done:
                column = "failed" if failed else "completed"
                db.execute(f"UPDATE batches SET {column} = {column} + 1 WHERE id = ?", (batch_id,))
        return bool(done)

    def enter(self, batch_id: str, owner: str, status: str, now: int) -> bool:
        with self._transaction() as db:
            if not self._owns(db, batch_id, owner):
                return False
            db.execute(f"UPDATE batches SET status = ?, {ENTERED[status]} = ? WHERE id = ?",
                       (status, now, batch_id))
        return True

    def finish(self, batch_id: str, owner: str, status: str, now: int,
               errors: list[wire.BatchError] | None = None) -> bool:
        """The batch ended as `status`: its done lines written, in order, to its output file (answers)
        and its error file (the rest), each made only when it has a line; the job no one's."""
        with self._transaction() as db:
            row = db.execute("SELECT tenant, owner FROM batches WHERE id = ?", (batch_id,)).fetchone()
            if row is None or row["owner"] != owner:
                return False
            made = {}
            for failed, column in ((0, "output_file_id"), (1, "error_file_id")):
                results = [r[0] for r in db.execute("SELECT result FROM lines WHERE batch_id = ? AND done = 1 AND "
                                                    "failed = ? ORDER BY idx", (batch_id, failed))]
                if results:
                    data = "".join(result + "\n" for result in results).encode()
                    name = f"{batch_id}_{'error' if failed else 'output'}.jsonl"
                    made[column] = self._insert_file(db, row["tenant"], name, wire.BATCH_OUTPUT, data, now).id
            listed = json.dumps(wire.BatchErrors(data=errors).model_dump()) if errors else None
            db.execute(f"UPDATE batches SET status = ?, {ENTERED[status]} = ?, output_file_id = ?, "
                       "error_file_id = ?, errors = COALESCE(?, errors), owner = NULL, lease_until = 0 WHERE id = ?",
                       (status, now, made.get("output_file_id"), made.get("error_file_id"), listed, batch_id))
            db.execute("DELETE FROM lines WHERE batch_id = ?", (batch_id,))
        return True

    def sweep(self, now: int) -> int:
        """Remove files past their retention, and batches ended that long ago; the files removed."""
        retention = self.bounds.retention
        placeholders = ", ".join("?" * len(wire.RUNNING))
        with self._transaction() as db:
            gone = [row[0] for row in db.execute("SELECT id FROM files WHERE expires_at <= ?", (now,))]
            db.execute("DELETE FROM files WHERE expires_at <= ?", (now,))
            db.execute(f"DELETE FROM batches WHERE created_at <= ? AND status NOT IN ({placeholders})",
                       (now - retention, *wire.RUNNING))
        for file_id in gone:
            (self._files / file_id).unlink(missing_ok=True)
        return len(gone)

    @staticmethod
    def _owns(db: sqlite3.Connection, batch_id: str, owner: str) -> bool:
        row = db.execute("SELECT owner FROM batches WHERE id = ?", (batch_id,)).fetchone()
        return row is not None and row[0] == owner


def not_found(kind: str, given: str, param: str | None = None) -> CoordinatorError:
    """404 for an id this tenant has no such thing by: another tenant's reads exactly as one never made."""
    return CoordinatorError(reasons.INVALID_REQUEST, f"no {kind} with id {given[:128]!r}", status=404, param=param)


def _bound(message: str, status: int = 400) -> CoordinatorError:
    return CoordinatorError(reasons.INVALID_REQUEST, message, status=status, param="file")


def _file(row: sqlite3.Row) -> wire.FileObject:
    return wire.FileObject(id=row["id"], bytes=row["bytes"], created_at=row["created_at"],
                           expires_at=row["expires_at"], filename=row["filename"], purpose=row["purpose"])


def _batch(row: sqlite3.Row) -> wire.Batch:
    errors = json.loads(row["errors"]) if row["errors"] else None
    return wire.Batch(
        id=row["id"], endpoint=row["endpoint"], input_file_id=row["input_file_id"], status=row["status"],
        created_at=row["created_at"], expires_at=row["expires_at"], output_file_id=row["output_file_id"],
        error_file_id=row["error_file_id"], errors=errors,
        metadata=json.loads(row["metadata"]) if row["metadata"] else None,
        request_counts=wire.RequestCounts(total=row["total"], completed=row["completed"], failed=row["failed"]),
        **{name: row[name] for name in _TIMES})
