"""A worker's stored Responses records over HTTP, as the coordinator calls them (worker/api/records.py):
kept, read and deleted per tenant, the worker token required, the body's bound enforced, and a model
swap or a session's end leaving them be (they are the process's, not a model's)."""

from __future__ import annotations

from pathlib import Path

import httpx

from tests.worker.server import running_worker

TOKEN = {"authorization": "Bearer t0ken"}


def test_records_are_kept_read_and_deleted_per_tenant_with_the_worker_token(tmp_path: Path) -> None:
    with running_worker(tmp_path / "none.gguf", engine="simulated", worker_token="t0ken",
                        responses_bytes_per_tenant=64 * 1024) as worker:
        url = worker.url + "/worker/responses/resp_abc"
        assert httpx.put(url + "?tenant=A", content=b'{"x":1}', timeout=5).status_code == 401  # no token
        kept = httpx.put(url + "?tenant=A", content=b'{"x":1}', headers=TOKEN, timeout=5)
        assert kept.status_code == 204, kept.text
        read = httpx.get(url + "?tenant=A", headers=TOKEN, timeout=5)
        assert (read.status_code, read.content) == (200, b'{"x":1}')
        other = httpx.get(url + "?tenant=B", headers=TOKEN, timeout=5)
        assert (other.status_code, other.json()["reason"]) == (404, "unknown_response")
        assert httpx.delete(url + "?tenant=B", headers=TOKEN, timeout=5).status_code == 404
        too_big = httpx.put(url + "?tenant=A", content=b"x" * (64 * 1024 + 1), headers=TOKEN, timeout=5)
        assert (too_big.status_code, too_big.json()["reason"]) == (413, "body_too_large")
        assert httpx.get(url + "?tenant=A", headers=TOKEN, timeout=5).status_code == 200  # kept as it was
        bad = httpx.get(worker.url + "/worker/responses/no%20spaces?tenant=A", headers=TOKEN, timeout=5)
        assert bad.status_code == 400
        assert httpx.delete(url + "?tenant=A", headers=TOKEN, timeout=5).status_code == 204
        assert httpx.get(url + "?tenant=A", headers=TOKEN, timeout=5).status_code == 404


def test_a_handover_gives_every_record_once_as_json(tmp_path: Path) -> None:
    with running_worker(tmp_path / "none.gguf", engine="simulated") as worker:
        for tenant, rid in (("A", "resp_1"), ("B", "resp_2")):
            put = httpx.put(f"{worker.url}/worker/responses/{rid}?tenant={tenant}",
                            content=b'{"response": {"id": "%s"}}' % rid.encode(), timeout=5)
            assert put.status_code == 204, put.text
        assert httpx.put(worker.url + "/worker/responses/resp_3", content=b"[1]", timeout=5).status_code == 400
        taken = httpx.post(worker.url + "/worker/responses/handover", timeout=5)
        again = httpx.post(worker.url + "/worker/responses/handover", timeout=5)
    assert taken.status_code == 200 and again.json() == {"records": []}
    assert taken.json()["records"] == [
        {"tenant": "A", "response_id": "resp_1", "record": {"response": {"id": "resp_1"}}},
        {"tenant": "B", "response_id": "resp_2", "record": {"response": {"id": "resp_2"}}}]
