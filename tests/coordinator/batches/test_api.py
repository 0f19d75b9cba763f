"""The Files and Batches APIs as the official `openai` package calls them, against the app in-process
with fake workers (coordinator/surfaces/files.py, batches.py; coordinator/batches/)."""

from __future__ import annotations

import asyncio
import io
import json
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from coordinator.app import create_app
from coordinator.auth import own_tenant
from coordinator.clock import ManualClock
from coordinator.settings import Settings
from protocol.batches import Batch
from tests.coordinator import fakes

pytestmark = pytest.mark.anyio
KEYS = {"A": "key-of-alpha", "B": "key-of-beta"}


@dataclass
class Worker:
    """A fake worker that answers every generation with one token and notes each request's body."""

    bodies: list[dict[str, Any]] = field(default_factory=list)
    hold: asyncio.Event | None = None  # set: answers wait for it

    def behaviour(self, request: httpx.Request) -> httpx.Response:
        self.bodies.append(json.loads(request.content))
        hold = self.hold

        async def body() -> AsyncIterator[bytes]:
            yield fakes.admitted()
            if hold is not None:
                await hold.wait()
            yield fakes.token(0, "ok")
            yield fakes.done(n=1)

        return httpx.Response(200, headers={"content-type": "text/event-stream", "x-worker-id": "w1"},
                              content=body())


@dataclass
class Pool:
    clients: dict[str, openai.AsyncOpenAI]
    http: httpx.AsyncClient
    worker: Worker
    transport: httpx.ASGITransport


@asynccontextmanager
async def pool(tmp_path: Path, keys: str = ",".join(KEYS.values()), **over: Any) -> AsyncIterator[Pool]:
    settings = Settings(heartbeat_interval=1.0, api_keys=keys, batch_dir=str(tmp_path), **over)
    clock, worker = ManualClock(), Worker()
    workers = fakes.FakeWorkers({"w1": worker.behaviour})
    app = create_app(settings, clock=clock, worker_client=workers.client())
    transport = httpx.ASGITransport(app=app)
    async with app.router.lifespan_context(app), httpx.AsyncClient(transport=transport,
                                                                   base_url="http://coord") as http:
        await fakes.register(http, fakes.heartbeat("w1", timestamp=clock.time()))
        clock.advance(settings.join_after)  # the coordinator knows the pool: its runner takes jobs
        await fakes.register(http, fakes.heartbeat("w1", timestamp=clock.time()))
        clients = {who: openai.AsyncOpenAI(api_key=key, base_url="http://coord/v1", max_retries=0,
                                           http_client=httpx.AsyncClient(transport=transport))
                   for who, key in KEYS.items()}
        yield Pool(clients, http, worker, transport)


def jsonl(*items: dict[str, Any] | str) -> bytes:
    return "".join((item if isinstance(item, str) else json.dumps(item)) + "\n" for item in items).encode()


def chat(custom_id: str, text: str = "hi", url: str = "/v1/chat/completions") -> dict[str, Any]:
    return {"custom_id": custom_id, "method": "POST", "url": url,
            "body": {"model": fakes.MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": 4}}


async def ended(client: openai.AsyncOpenAI, batch_id: str, timeout: float = 5.0) -> Batch:
    async with asyncio.timeout(timeout):
        while True:
            batch = await client.batches.retrieve(batch_id)
            if batch.status in ("completed", "failed", "expired", "cancelled"):
                return Batch.model_validate(batch.model_dump())
            await asyncio.sleep(0.02)


async def lines_of(client: openai.AsyncOpenAI, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    content = await client.files.content(file_id)
    return [json.loads(line) for line in content.text.splitlines()]


async def test_a_batch_of_chats_answers_each_line_once_in_the_batch_class(tmp_path: Path) -> None:
    async with pool(tmp_path) as p:
        client = p.clients["A"]
        data = jsonl(*(chat(f"req-{i}", f"question {i}") for i in range(1000)))
        uploaded = await client.files.create(file=("in.jsonl", io.BytesIO(data)), purpose="batch")
        assert (uploaded.purpose, uploaded.bytes) == ("batch", len(data))
        batch = await client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                            completion_window="24h", metadata={"run": "t1"})
        assert batch.status == "validating" and batch.metadata == {"run": "t1"}
        done = await ended(client, batch.id, timeout=60)
        assert done.status == "completed" and done.error_file_id is None
        assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (1000, 1000, 0)
        out = await lines_of(client, done.output_file_id)
        assert sorted(line["custom_id"] for line in out) == sorted(f"req-{i}" for i in range(1000))
        first = out[0]
        assert first["error"] is None and first["response"]["status_code"] == 200
        assert first["response"]["body"]["choices"][0]["message"]["content"] == "ok"
        assert first["id"].startswith("batch_req_") and first["response"]["request_id"] == first["id"]
        # Each line went to the worker once, in the batch class, as the key's tenant.
        assert len(p.worker.bodies) == 1000
        assert {b["priority"] for b in p.worker.bodies} == {"batch"}
        assert {b["tenant"] for b in p.worker.bodies} == {own_tenant(KEYS["A"])}
        listed = await client.batches.list()
        assert [b.id for b in listed.data] == [batch.id]
        # Charged to the tenant's fair share like any request: 5 prompt + 1 generated tokens a line.
        metrics = (await p.http.get("/metrics", headers={"authorization": f"Bearer {KEYS['A']}"})).text
        served = [line for line in metrics.splitlines() if line.startswith("coordinator_tenant_tokens_total{")
                  and own_tenant(KEYS["A"]) in line]
        assert sum(float(line.rsplit(" ", 1)[1]) for line in served) == 6 * 1000


async def test_bad_lines_become_error_lines_and_the_rest_runs(tmp_path: Path) -> None:
    async with pool(tmp_path) as p:
        client = p.clients["A"]
        data = jsonl(chat("good-1"), "{not json", chat("wrong-url", url="/v1/embeddings"),
                     {**chat("refused"), "body": {"model": fakes.MODEL, "messages": [], "max_tokens": -3}},
                     {**chat("unknown-model"), "body": {"model": "nope", "messages": [{"role": "user", "content": "x"}]}},
                     chat("good-1"), chat("good-2"))
        uploaded = await client.files.create(file=("in.jsonl", io.BytesIO(data)), purpose="batch")
        batch = await client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                            completion_window="24h")
        done = await ended(client, batch.id)
        assert done.status == "completed"
        assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (7, 2, 5)
        out = await lines_of(client, done.output_file_id)
        assert [line["custom_id"] for line in out] == ["good-1", "good-2"]
        errors = {line["custom_id"]: line for line in await lines_of(client, done.error_file_id)}
        assert errors[None]["error"]["code"] == "invalid_json_line" and errors[None]["response"] is None
        assert errors["wrong-url"]["error"]["code"] == "invalid_url"
        assert errors["refused"]["response"]["status_code"] == 400
        assert errors["refused"]["response"]["body"]["error"]["type"] == "invalid_request_error"
        assert errors["unknown-model"]["response"]["status_code"] == 404
        assert errors["good-1"]["error"]["code"] == "duplicate_custom_id"  # the second line of that id
        assert len(errors) == 5
        assert len(p.worker.bodies) == 2


async def test_another_tenants_files_and_batches_are_not_found(tmp_path: Path) -> None:
    async with pool(tmp_path) as p:
        alpha, beta = p.clients["A"], p.clients["B"]
        uploaded = await alpha.files.create(file=("in.jsonl", io.BytesIO(jsonl(chat("x")))), purpose="batch")
        batch = await alpha.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                           completion_window="24h")
        for read in (beta.files.retrieve(uploaded.id), beta.files.content(uploaded.id), beta.files.delete(uploaded.id),
                     beta.batches.retrieve(batch.id), beta.batches.cancel(batch.id)):
            with pytest.raises(openai.NotFoundError):
                await read
        with pytest.raises(openai.NotFoundError):  # nor may B run A's file as its own batch
            await beta.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                      completion_window="24h")
        assert (await beta.files.list()).data == [] and (await beta.batches.list()).data == []
        assert [f.id for f in (await alpha.files.list()).data] == [uploaded.id]
        assert (await p.http.get("/v1/files")).status_code == 401  # no key, nothing


async def test_a_file_past_a_bound_is_refused_naming_it(tmp_path: Path) -> None:
    async with pool(tmp_path, batch_file_max_lines=3, batch_tenant_max_files=1) as p:
        client = p.clients["A"]
        with pytest.raises(openai.BadRequestError, match="BATCH_FILE_MAX_LINES"):
            await client.files.create(file=("in.jsonl", io.BytesIO(jsonl(*(chat(f"{i}") for i in range(4))))),
                                      purpose="batch")
        await client.files.create(file=("in.jsonl", io.BytesIO(jsonl(chat("a")))), purpose="batch")
        with pytest.raises(openai.BadRequestError, match="BATCH_TENANT_MAX_FILES"):
            await client.files.create(file=("in.jsonl", io.BytesIO(jsonl(chat("b")))), purpose="batch")
        with pytest.raises(openai.BadRequestError, match="purpose"):
            await p.clients["B"].files.create(file=("in.jsonl", io.BytesIO(jsonl(chat("b")))), purpose="assistants")


async def test_cancel_mid_job_ends_the_lines_running_and_runs_no_more(tmp_path: Path) -> None:
    async with pool(tmp_path, batch_max_in_flight=2) as p:
        client = p.clients["A"]
        p.worker.hold = asyncio.Event()
        uploaded = await client.files.create(file=("in.jsonl", io.BytesIO(jsonl(*(chat(f"{i}") for i in range(20))))),
                                             purpose="batch")
        batch = await client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                            completion_window="24h")
        async with asyncio.timeout(5):
            while len(p.worker.bodies) < 2:
                await asyncio.sleep(0.01)
        cancelling = await client.batches.cancel(batch.id)
        assert cancelling.status == "cancelling"
        done = await ended(client, batch.id)
        assert done.status == "cancelled" and done.cancelled_at is not None
        assert done.request_counts.completed == 0 and len(p.worker.bodies) == 2
        assert done.output_file_id is None


async def test_a_keys_budget_holds_for_its_batch_lines_past_it_are_error_lines(tmp_path: Path) -> None:
    async with pool(tmp_path, keys=f"{KEYS['A']} budget=20,{KEYS['B']}", batch_max_in_flight=1) as p:
        client = p.clients["A"]
        uploaded = await client.files.create(file=("in.jsonl", io.BytesIO(jsonl(*(chat(f"{i}") for i in range(8))))),
                                             purpose="batch")
        batch = await client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                            completion_window="24h")
        done = await ended(client, batch.id)
        counts = done.request_counts
        assert done.status == "completed" and counts.completed == 4 and counts.failed == 4  # 6 tokens a line
        errors = await lines_of(client, done.error_file_id)
        assert {(e["response"]["status_code"], e["response"]["body"]["error"]["code"]) for e in errors} == {
            (429, "budget_exceeded")}
        assert len(p.worker.bodies) == 4


async def test_two_coordinators_on_one_store_run_a_job_once_and_the_other_takes_it_over(tmp_path: Path) -> None:
    async with AsyncExitStack() as one, AsyncExitStack() as two:
        stacks = (one, two)
        pools = [await stack.enter_async_context(pool(tmp_path, batch_max_in_flight=4)) for stack in stacks]
        for p in pools:
            p.worker.hold = asyncio.Event()  # not set: their lines run until it is
        client = pools[0].clients["A"]
        uploaded = await client.files.create(
            file=("in.jsonl", io.BytesIO(jsonl(*(chat(f"{i}") for i in range(40))))), purpose="batch")
        batch = await client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                            completion_window="24h")
        async with asyncio.timeout(5):
            while sum(len(p.worker.bodies) for p in pools) < 4:
                await asyncio.sleep(0.01)
        await asyncio.sleep(0.3)
        # One coordinator holds the job; the other runs none of it.
        (holder,) = [i for i, p in enumerate(pools) if p.worker.bodies]
        assert len(pools[holder].worker.bodies) == 4
        await stacks[holder].aclose()  # it stops, its lease given back: the other takes the job over
        other = pools[1 - holder]
        other.worker.hold.set()  # type: ignore[union-attr]
        done = await ended(other.clients["A"], batch.id, timeout=10)
        assert done.status == "completed" and done.request_counts.completed == 40
        assert len(other.worker.bodies) == 40  # the four cut short ran again, here, once
        out = await lines_of(other.clients["A"], done.output_file_id)
        assert sorted(line["custom_id"] for line in out) == sorted(str(i) for i in range(40))


async def test_a_fault_answering_a_line_is_that_lines_500_and_the_rest_runs(tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    from coordinator.surfaces import batches as surface

    chat_handler = surface.HANDLERS["/v1/chat/completions"]

    async def faulty(request: Any) -> Any:
        if b"boom" in await request.body():
            raise RuntimeError("a bug")
        return await chat_handler(request)

    monkeypatch.setitem(surface.HANDLERS, "/v1/chat/completions", faulty)
    async with pool(tmp_path) as p:
        client = p.clients["A"]
        uploaded = await client.files.create(file=("in.jsonl", io.BytesIO(jsonl(chat("a"), chat("b", "boom"), chat("c")))),
                                             purpose="batch")
        batch = await client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                            completion_window="24h")
        done = await ended(client, batch.id)
        assert done.status == "completed" and (done.request_counts.completed, done.request_counts.failed) == (2, 1)
        (error,) = await lines_of(client, done.error_file_id)
        assert error["custom_id"] == "b" and error["response"]["status_code"] == 500
