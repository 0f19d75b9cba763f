"""The batch store (coordinator/batches/store.py): tenancy, bounds, each line recorded once, the lease."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from coordinator.batches import lines
from coordinator.batches.store import Bounds, Store
from coordinator.errors import CoordinatorError
from protocol import batches as wire

pytestmark = pytest.mark.unit
BOUNDS = Bounds(file_bytes=10_000, file_lines=10, tenant_files=3, tenant_bytes=20_000, retention=3600)
NOW = 1_000_000


def chat_lines(n: int) -> bytes:
    return "".join(json.dumps({"custom_id": f"c{i}", "method": "POST", "url": "/v1/chat/completions",
                               "body": {"messages": [{"role": "user", "content": f"q{i}"}]}}) + "\n"
                   for i in range(n)).encode()


def started(store: Store, tenant: str = "t:a", n: int = 4) -> str:
    """A batch of `n` lines claimed by `one` and read in."""
    file = store.add_file(tenant, "in.jsonl", wire.BATCH, chat_lines(n), NOW)
    batch = store.create_batch(tenant, "key", wire.BatchCreate(input_file_id=file.id, endpoint="/v1/chat/completions",
                                                               completion_window="24h"), NOW, 86_400)
    (row,) = store.claim("one", NOW, 30, 4)
    assert row.batch.id == batch.id and (row.tenant, row.key_id) == (tenant, "key")
    assert store.load(batch.id, "one", lines.read(chat_lines(n), batch.endpoint), [], NOW)
    return batch.id


def test_a_tenant_finds_only_its_own_files_and_batches(tmp_path: Path) -> None:
    store = Store(tmp_path, BOUNDS)
    batch_id = started(store)
    (file,) = store.files("t:a", None, None, 10).data
    assert store.file("t:b", file.id) is None and store.content("t:b", file.id) is None
    assert not store.delete_file("t:b", file.id) and store.file("t:a", file.id) is not None
    assert store.batch("t:b", batch_id) is None and store.cancel("t:b", batch_id, NOW) is None
    assert store.files("t:b", None, None, 10).data == [] and store.batches("t:b", None, 10).data == []
    with pytest.raises(CoordinatorError) as refused:
        store.create_batch("t:b", None, wire.BatchCreate(input_file_id=file.id, endpoint="/v1/chat/completions",
                                                         completion_window="24h"), NOW, 60)
    assert refused.value.status == 404


@pytest.mark.parametrize(("bounds", "named"), [
    (Bounds(200, 10, 3, 20_000, 60), "BATCH_FILE_MAX_BYTES"),
    (Bounds(10_000, 2, 3, 20_000, 60), "BATCH_FILE_MAX_LINES"),
    (Bounds(10_000, 10, 1, 20_000, 60), "BATCH_TENANT_MAX_FILES"),
    (Bounds(10_000, 10, 3, 300, 60), "BATCH_TENANT_MAX_BYTES"),
])
def test_a_file_past_a_bound_is_refused_naming_the_bound(tmp_path: Path, bounds: Bounds, named: str) -> None:
    store = Store(tmp_path, bounds)
    store.add_file("t:other", "x.jsonl", wire.BATCH, chat_lines(1), NOW)  # another tenant's count nothing
    store.add_file("t:a", "x.jsonl", wire.BATCH, chat_lines(1), NOW)
    with pytest.raises(CoordinatorError, match=named):
        store.add_file("t:a", "y.jsonl", wire.BATCH, chat_lines(3), NOW)


def test_a_line_is_recorded_once_and_a_restarted_store_resumes_where_it_stopped(tmp_path: Path) -> None:
    store = Store(tmp_path, BOUNDS)
    batch_id = started(store)
    assert store.record(batch_id, "one", 0, '{"line": 0}', failed=False)
    assert not store.record(batch_id, "one", 0, '{"line": "again"}', failed=False)  # done: not written twice
    assert store.record(batch_id, "one", 2, '{"line": 2}', failed=True)
    store.close()
    again = Store(tmp_path, BOUNDS)  # the coordinator restarted: the same directory
    assert [line.index for line in again.pending(batch_id, -1, 10)] == [1, 3]
    counts = again.batch("t:a", batch_id)
    assert counts is not None and counts.request_counts == wire.RequestCounts(total=4, completed=1, failed=1)
    # Its runner is gone; once its lease has lapsed another takes the job over and finishes it.
    assert again.claim("two", NOW + 10, 30, 4) == []
    assert [r.batch.id for r in again.claim("two", NOW + 31, 30, 4)] == [batch_id]
    assert not again.record(batch_id, "one", 1, '{"late": 1}', failed=False)  # the old owner is fenced off
    assert again.record(batch_id, "two", 1, '{"line": 1}', failed=False)
    assert again.record(batch_id, "two", 3, '{"line": 3}', failed=False)
    assert again.enter(batch_id, "two", wire.FINALIZING, NOW + 40)
    assert again.finish(batch_id, "two", wire.COMPLETED, NOW + 41)
    done = again.batch("t:a", batch_id)
    assert done is not None and done.status == wire.COMPLETED and done.completed_at == NOW + 41
    output = again.content("t:a", done.output_file_id or "")
    errors = again.content("t:a", done.error_file_id or "")
    assert output == b'{"line": 0}\n{"line": 1}\n{"line": 3}\n' and errors == b'{"line": 2}\n'
    assert again.claim("three", NOW + 100, 30, 4) == []  # ended: nobody's job


def test_a_renewed_lease_keeps_the_job_and_a_cancel_shows_in_it(tmp_path: Path) -> None:
    store = Store(tmp_path, BOUNDS)
    batch_id = started(store)
    renewed = store.renew(batch_id, "one", NOW + 20, 30)
    assert renewed is not None and renewed.status == wire.IN_PROGRESS
    assert store.claim("two", NOW + 40, 30, 4) == []  # renewed until NOW + 50
    assert store.cancel("t:a", batch_id, NOW + 41) is not None
    cancelling = store.renew(batch_id, "one", NOW + 42, 30)
    assert cancelling is not None and cancelling.status == wire.CANCELLING
    store.release(batch_id, "one")
    assert len(store.claim("two", NOW + 43, 30, 4)) == 1  # given up: taken at once
    assert store.renew(batch_id, "one", NOW + 44, 30) is None


def test_files_and_ended_batches_go_after_the_retention(tmp_path: Path) -> None:
    store = Store(tmp_path, BOUNDS)
    batch_id = started(store)
    assert store.finish(batch_id, "one", wire.CANCELLED, NOW + 1)
    assert store.sweep(NOW + 3599) == 0
    assert store.sweep(NOW + 3600) == 1 and store.files("t:a", None, None, 10).data == []
    assert store.batch("t:a", batch_id) is None
    assert list((tmp_path / "files").iterdir()) == []


def test_lists_are_paged_newest_first(tmp_path: Path) -> None:
    store = Store(tmp_path, Bounds(10_000, 10, 10, 100_000, 3600))
    ids = [store.add_file("t:a", f"{i}.jsonl", wire.BATCH, chat_lines(1), NOW + i).id for i in range(5)]
    first = store.files("t:a", None, None, 2)
    assert [f.id for f in first.data] == ids[:2:-1][:2] and first.has_more
    rest = store.files("t:a", wire.BATCH, first.last_id, 10)
    assert [f.id for f in rest.data] == ids[2::-1] and not rest.has_more
