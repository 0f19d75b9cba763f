"""The SIMULATED engine: same API, admission and accounting as a real worker, no model."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

from protocol.worker import GenerateRequest
from tests.polling import wait_until
from tests.sse import generate
from tests.worker.server import running_worker
from worker.admission import Gate
from worker.backends.simulated import SimulatedEngine, SimulatedModel
from worker.engine.channel import TokenChannel
from worker.engine.jobs import EngineConfig, Finished, Job, StreamItem
from worker.headroom import Headroom
from worker.naming import ModelNames
from worker.sessions.table import KvLimits, SessionTable
from worker.settings import WorkerSettings


def test_simulated_engine_is_never_the_default() -> None:
    assert WorkerSettings.load([], environ={}).engine == "llama"


def test_simulated_worker_streams_accounts_and_refuses_like_a_real_one(tmp_path: Path) -> None:
    with running_worker(tmp_path / "no-model.gguf", engine="simulated", sim_token_rate=200.0,
                        max_sessions=2) as worker:
        assert worker.health()["model"] == "simulated"
        stream = generate(worker.url, {"prompt": "hello", "max_tokens": 12, "session_id": "sim-chat"})
        event, done = stream.last
        assert event == "done" and done["usage"]["completion_tokens"] == 12 == len(stream.tokens)
        assert [t["index"] for t in stream.tokens] == list(range(12))
        kept = worker.load()
        assert kept["sessions"] == 1 and kept["kv_used_bytes"] == (done["usage"]["total_tokens"] - 1) * 23040
        again = generate(worker.url, {"prompt": "more", "max_tokens": 4, "session_id": "sim-chat"})
        assert again.last[1]["usage"]["cached_tokens"] > 0
        too_long = generate(worker.url, {"prompt": "x" * 4000, "max_tokens": 4})
        assert too_long.refusal is not None and too_long.refusal["reason"] == "prompt_too_long"


def test_simulated_cancel_frees_kv(tmp_path: Path) -> None:
    import httpx

    with running_worker(tmp_path / "none.gguf", engine="simulated", sim_token_rate=100.0) as worker:
        with httpx.Client(timeout=10) as client, client.stream(
                "POST", worker.url + "/worker/generate", json={"prompt": "go", "max_tokens": 500}) as response:
            for line in response.iter_lines():
                if line.startswith("event: token"):
                    break
        wait_until(lambda: worker.load()["kv_reserved_bytes"] == 0, 3.0, "the reservation to be released")


def test_simulated_stream_ends_at_a_stop_string_by_the_engines_own_rules(tmp_path: Path) -> None:
    """Before: the simulator had its own ending rules and no stop strings (its 'brown' came through)."""
    with running_worker(tmp_path / "none.gguf", engine="simulated", sim_token_rate=500.0) as worker:
        stream = generate(worker.url, {"prompt": "go", "max_tokens": 12, "stop": ["brown"]})
        event, done = stream.last
        text = "".join(t["token"] for t in stream.tokens)
        assert event == "done" and done["finish_reason"] == "stop"
        assert text == " the quick " and "brown" not in text


def test_a_deleted_sessions_queued_job_is_cancelled_before_it_runs() -> None:
    """Before: the simulator cancelled only running jobs, so a job still in its inbox ran on after
    its session was deleted. Both engines now cancel through worker/engine/endings.py."""
    assert asyncio.run(queued_then_cancelled()) == ("cancelled", 0)


async def queued_then_cancelled() -> tuple[str, int]:
    engine = SimulatedEngine(SimulatedModel(), EngineConfig(ctx_size=1024, max_sessions=2, threads=1),
                             token_rate=1000.0, prefill_rate=1e6)
    table = SessionTable(KvLimits(capacity_tokens=1024, session_max_tokens=512, max_sessions=2,
                                  bytes_per_token=1), clock=lambda: 0.0, ttl=60)
    engine.bind(table)
    loop = asyncio.get_running_loop()
    session = table.admit("s", 64, [1, 2, 3]).session
    channel = TokenChannel[StreamItem](loop, 64)
    job = Job(request_id="r", request=GenerateRequest(prompt="go", max_tokens=50, session_id="s"), session=session,
              prompt_tokens=[1, 2, 3], cached_tokens=0, history=[], channel=channel, admitted_at=0.0)
    engine.submit(job)
    engine.cancel_session(session)  # before the engine ever took it from its inbox
    engine.start(loop)
    try:
        items: list[StreamItem] = []
        while not items or not isinstance(items[-1], Finished):
            items.append(await asyncio.wait_for(channel.get(), 5))
    finally:
        engine.stop()
    last = items[-1]
    assert isinstance(last, Finished)
    return last.reason, last.completion_tokens


class SlowTokenizer(SimulatedModel):
    """Counts how many prompts are being tokenized at once."""

    def __init__(self) -> None:
        super().__init__()
        self.now = self.most = 0
        self._lock = threading.Lock()

    def tokenize(self, text: str, *, add_special: bool) -> list[int]:
        with self._lock:
            self.now += 1
            self.most = max(self.most, self.now)
        time.sleep(0.05)
        with self._lock:
            self.now -= 1
        return super().tokenize(text, add_special=add_special)


def test_prompts_are_tokenized_a_bounded_number_at_a_time() -> None:
    """Before: every admitted request tokenized in its own thread at once, so a burst of long prompts
    took every core from the decode loop."""
    assert asyncio.run(tokenizing_at_most(requests=6)) == 2


def simulated_gate(model: SimulatedModel, *, sessions: int = 8) -> Gate:
    """A worker's admission over the simulated engine (no HTTP, no model file); call inside a loop."""
    engine = SimulatedEngine(model, EngineConfig(ctx_size=512 * sessions, max_sessions=sessions, threads=1),
                             token_rate=1000.0, prefill_rate=1e6)
    table = SessionTable(KvLimits(capacity_tokens=512 * sessions, session_max_tokens=512, max_sessions=sessions,
                                  bytes_per_token=1), clock=lambda: 0.0, ttl=60)
    engine.bind(table)
    return Gate(model, ModelNames.choose(configured="", configured_aliases=(), general_name=None,
                                         file_stem="sim"), table, engine, stream_buffer=8, clock=lambda: 0.0)


async def tokenizing_at_most(requests: int) -> int:
    model = SlowTokenizer()
    gate = simulated_gate(model)
    await asyncio.gather(*(gate.admit(GenerateRequest(prompt=f"prompt {i}", max_tokens=4), f"r{i}")
                           for i in range(requests)))
    return model.most


def test_simulated_choices_end_on_their_own_and_give_every_sequence_back(tmp_path: Path) -> None:
    """n = 4: four sequences (choice i starts i words on), each ending by the shared rules on its own
    (here a stop string reached after 1 to 3 words, or max_tokens), one `done` counting them all."""
    with running_worker(tmp_path / "none.gguf", engine="simulated", sim_token_rate=500.0, max_sessions=4) as worker:
        stream = generate(worker.url, {"prompt": "go", "max_tokens": 3, "stop": ["fox"], "n": 4})
        event, done = stream.last
        assert event == "done"
        texts = ["".join(t["token"] for t in stream.tokens if t.get("choice", 0) == i) for i in range(4)]
        assert texts == [" the quick brown", " quick brown ", " brown ", " "]
        assert done["choices"] == [{"finish_reason": "length", "completion_tokens": 3},
                                   {"finish_reason": "stop", "completion_tokens": 3},
                                   {"finish_reason": "stop", "completion_tokens": 2},
                                   {"finish_reason": "stop", "completion_tokens": 1}]
        assert done["finish_reason"] == "length" and done["usage"]["completion_tokens"] == 9
        wait_until(lambda: worker.load()["sessions"] == 0 == worker.load()["kv_reserved_bytes"], 3.0,
                   "every choice's sequence to be free")
        # More choices than the worker has sequences can never run: refused before the head.
        assert generate(worker.url, {"prompt": "go", "n": 5}).status == 400


def test_simulated_choices_failing_or_cancelled_free_every_sequence(tmp_path: Path) -> None:
    import httpx

    with running_worker(tmp_path / "none.gguf", engine="simulated", sim_token_rate=100.0, max_sessions=4,
                        request_timeout=0.3) as worker:
        failed = generate(worker.url, {"prompt": "go", "max_tokens": 500, "n": 3})
        assert [event for event, _ in failed.events].count("error") == 1
        assert failed.last[0] == "error" and failed.last[1]["reason"] == "deadline_exceeded"
        wait_until(lambda: worker.load()["sessions"] == 0 == worker.load()["kv_reserved_bytes"], 3.0,
                   "the failed request's sequences to be free")
    with running_worker(tmp_path / "none.gguf", engine="simulated", sim_token_rate=100.0, max_sessions=4) as worker:
        with httpx.Client(timeout=10) as client, client.stream(
                "POST", worker.url + "/worker/generate", json={"prompt": "go", "max_tokens": 500, "n": 4}) as response:
            lines = response.iter_lines()  # kept: dropping it closes the connection
            while not next(lines).startswith("event: token"):
                pass
            assert worker.load()["sessions"] == 4
        wait_until(lambda: worker.load()["sessions"] == 0 == worker.load()["kv_reserved_bytes"], 3.0,
                   "the cancelled request's sequences to be free")


def test_with_a_room_wait_a_request_refused_for_capacity_waits_for_a_sequence(tmp_path: Path) -> None:
    """WORKER_ROOM_WAIT (the default with several coordinators): a request that finds every sequence
    taken waits for one to free up, in arrival order, and is served; without it, 503 at once."""
    for room_wait, served in ((2.0, True), (0.0, False)):
        with running_worker(tmp_path / "no-model.gguf", engine="simulated", sim_token_rate=20.0, max_sessions=1,
                            room_wait=room_wait) as worker:
            first = threading.Thread(target=generate, args=(worker.url, {"prompt": "first", "max_tokens": 10,
                                                                           "ignore_eos": True}))
            first.start()
            wait_until(lambda w=worker: w.load()["sessions"] == 1, 10, "the first request running")
            started = time.monotonic()
            second = generate(worker.url, {"prompt": "second", "max_tokens": 2, "ignore_eos": True})
            first.join(30)
            if served:
                assert second.last[0] == "done" and time.monotonic() - started >= 0.2, second.refusal
            else:
                assert second.refusal is not None and second.refusal["reason"] == "sessions_full"
            assert worker.load()["sessions"] == 0



def test_with_a_room_wait_a_newcomer_takes_its_place_behind_the_requests_already_waiting() -> None:
    """Several coordinators: a request that finds others waiting for room waits behind them, even when a
    sequence is free at that moment (its release not yet handed to the first in line), and each
    release is handed to the first in line. Before, the newcomer took the sequence: the coordinator
    whose own stream had just ended was served ahead of the others' queued requests."""
    assert asyncio.run(served_in_order()) == ["waiting", "newcomer"]


async def served_in_order() -> list[str]:
    gate = simulated_gate(SimulatedModel(), sessions=1)
    gate.room_wait = 5.0
    served: list[str] = []

    async def admit(name: str) -> Job:
        job = await gate.admit(GenerateRequest(prompt=name, max_tokens=4), name)
        served.append(name)
        return job

    held = gate.table.admit(None, 8).session  # the worker's one sequence, taken
    waiting = asyncio.create_task(admit("waiting"))
    await asyncio.sleep(0.2)
    gate.table.release(held, keep_kv=False)  # free, and the first in line not told yet
    newcomer = asyncio.create_task(admit("newcomer"))
    await asyncio.sleep(0.2)
    assert served == []  # the newcomer did not take it
    gate.released()  # the release reaches the line: its first takes the sequence
    first = await asyncio.wait_for(waiting, 2)
    await asyncio.sleep(0.1)
    assert served == ["waiting"]
    gate.table.release(first.session, keep_kv=False)
    gate.released()
    await asyncio.wait_for(newcomer, 2)
    return served


def test_with_several_coordinators_a_freed_sequence_of_a_full_worker_is_beaten_to_all_at_once(
        tmp_path: Path) -> None:
    """Every coordinator learns at once that a full worker has room (a heartbeat to each), not only the
    one whose stream ended; with one coordinator that one knows already, and nothing extra is sent."""
    import httpx

    for urls, extra in (("http://c1.test,http://c2.test", 2), ("http://c1.test", 0)):
        beats: list[str] = []
        coordinators = len(urls.split(","))

        def coordinator(request: httpx.Request, beats: list[str] = beats) -> httpx.Response:
            beats.append(request.url.host)
            return httpx.Response(200, json={})

        with running_worker(tmp_path / "no-model.gguf", engine="simulated", sim_token_rate=50.0, max_sessions=1,
                            coordinator_url=urls, heartbeat_interval=30.0,
                            transport=httpx.MockTransport(coordinator)) as worker:
            wait_until(lambda b=beats, n=coordinators: len(b) >= n, 10, "the first beats")
            time.sleep(0.3)
            before = len(beats)
            assert generate(worker.url, {"prompt": "go", "max_tokens": 3, "ignore_eos": True}).last[0] == "done"
            time.sleep(0.5)
            assert len(beats) - before == extra, beats

def test_the_room_wait_defaults_to_two_seconds_with_several_coordinators_only() -> None:
    from worker.settings import WorkerSettings

    assert WorkerSettings(coordinator_url="http://c1:1337").room_wait_seconds == 0.0
    assert WorkerSettings(coordinator_url="http://c1:1337,http://c2:1337").room_wait_seconds == 2.0
    assert WorkerSettings(coordinator_url="http://c:1337", coordinator_resolve_all=True).room_wait_seconds == 2.0
    assert WorkerSettings(coordinator_url="http://c1:1337,http://c2:1337", room_wait=0.5).room_wait_seconds == 0.5


def test_an_interactive_request_waits_in_line_before_batch_requests_that_came_first() -> None:
    """The room-wait line by class: a release goes to the interactive request that came last before the
    batch ones that waited longer; within a class, first come, first served."""
    assert asyncio.run(line_order()) == ["urgent", "batch-0", "batch-1"]


async def line_order() -> list[str]:
    gate = simulated_gate(SimulatedModel(), sessions=1)
    gate.room_wait = 5.0
    served: list[str] = []

    async def admit(name: str, priority: str) -> None:
        job = await gate.admit(GenerateRequest(prompt=name, max_tokens=4, priority=priority), name)  # type: ignore[arg-type]
        served.append(name)
        gate.table.release(job.session, keep_kv=False)
        gate.released()

    held = gate.table.admit(None, 8).session
    tasks = []
    for name, priority in (("batch-0", "batch"), ("batch-1", "batch"), ("urgent", "interactive")):
        tasks.append(asyncio.create_task(admit(name, priority)))
        await asyncio.sleep(0.05)
    gate.table.release(held, keep_kv=False)
    gate.released()
    await asyncio.wait_for(asyncio.gather(*tasks), 5)
    return served


def test_within_a_class_a_release_goes_to_the_tenant_holding_the_fewest_sequences_here() -> None:
    """Several coordinators send to one worker: its line gives a freed sequence to the waiting tenant that
    holds the fewest here, then to the first to wait, whichever coordinator sent it."""
    assert asyncio.run(tenant_order()) == ["light", "heavy-0", "heavy-1"]


async def tenant_order() -> list[str]:
    gate = simulated_gate(SimulatedModel(), sessions=3)
    gate.room_wait = 5.0
    served: list[str] = []
    held = [gate.table.admit(None, 8, tenant="heavy").session for _ in range(2)]
    held.append(gate.table.admit(None, 8, tenant="light").session)

    async def admit(name: str, tenant: str) -> None:
        job = await gate.admit(GenerateRequest(prompt=name, max_tokens=4, tenant=tenant), name)
        served.append(name)
        gate.table.release(job.session, keep_kv=False)
        gate.released()

    tasks = []
    for name, tenant in (("heavy-0", "heavy"), ("heavy-1", "heavy"), ("light", "light")):
        tasks.append(asyncio.create_task(admit(name, tenant)))
        await asyncio.sleep(0.05)
    gate.table.release(held.pop(), keep_kv=False)  # light's own: now heavy holds 2 here, light none
    gate.released()
    await asyncio.sleep(0.2)
    for session in held:
        gate.table.release(session, keep_kv=False)
        gate.released()
    await asyncio.wait_for(asyncio.gather(*tasks), 5)
    return served


def test_with_fair_shares_the_last_free_sequence_waits_for_the_tenant_below_its_share() -> None:
    """worker/headroom.py through the gate: a flooding tenant that holds its share or more is not given
    the last free sequence while another tenant was active here; it waits in line, and the other
    tenant's request, arriving later, takes that sequence at once. Without `fair_share` (fair shares off
    at the coordinator) the flood takes it."""
    assert asyncio.run(kept_for_light(fair=True)) == ["light", "heavy"]
    assert asyncio.run(kept_for_light(fair=False)) == ["heavy"]
    assert asyncio.run(kept_for_light(fair=True, priority="batch")) == ["heavy"]  # batch fills idle room


async def kept_for_light(*, fair: bool, priority: str = "interactive") -> list[str]:
    gate = simulated_gate(SimulatedModel(), sessions=4)
    gate.room_wait = 5.0
    gate.headroom = Headroom(4, time.monotonic)
    served: list[str] = []
    held = [gate.table.admit(None, 8, tenant="heavy").session for _ in range(3)]
    gate.ended(GenerateRequest(prompt="earlier", max_tokens=4, tenant="light", fair_share=fair))  # light ran here

    async def admit(name: str) -> Job:
        job = await gate.admit(GenerateRequest(prompt=name, max_tokens=4, tenant=name, fair_share=fair,
                                               priority=priority if name == "heavy" else "interactive"), name)  # type: ignore[arg-type]
        served.append(name)
        return job

    heavy = asyncio.create_task(admit("heavy"))
    await asyncio.sleep(0.2)
    if not fair or priority == "batch":
        await asyncio.wait_for(heavy, 2)
        return served
    assert served == []  # one sequence free, kept for light: heavy waits in line
    light = await asyncio.wait_for(admit("light"), 2)  # not behind heavy in line: it holds fewer
    gate.table.release(held.pop(), keep_kv=False)  # a flood's stream ends: heavy holds 2, its share of 4,
    gate.released()                                 # and light 1 below its 2: the free one is kept
    await asyncio.sleep(0.2)
    assert served == ["light"]
    gate.table.release(held.pop(), keep_kv=False)  # another: heavy is below its share, its turn
    gate.released()
    await asyncio.wait_for(heavy, 2)
    gate.table.release(light.session, keep_kv=False)
    return served
