"""The pool over a real (virtual) network: five worker hosts and a coordinator host on one bridge.

Checks what only a network shows: requests spread over hosts that registered by heartbeat across
it; a host unplugged mid-stream ends its streams with an `error` event within the coordinator's read
deadline, new requests go elsewhere, nothing admitted is lost without an explicit error, and the host
rejoins once plugged back; latency added to one host shows in its TTFT only; a drained host's kept session moves across the bridge
to another host, and one cut off mid-move ends the move on both sides and is said to be lost.
The figures are printed at the end (`-s`) and written to `<pytest tmp>/multihost*/multihost-figures.json`.
"""

from __future__ import annotations

import itertools
import signal
import statistics
import time
from collections import Counter, defaultdict
from typing import Any

import httpx
import pytest

from tests.multihost.client import Streamed, wait
from tests.multihost.conftest import (
    CONNECT_TIMEOUT,
    FIRST_EVENT_TIMEOUT,
    HEARTBEAT_INTERVAL,
    READ_TIMEOUT,
    TOKEN,
    WORKER_PORT,
    WORKERS,
    Pool,
)

pytestmark = pytest.mark.model

SHORT = {"prompt": "Say hello.", "max_tokens": 4, "ignore_eos": True}
LONG = {"prompt": "Count slowly from one to a thousand.", "max_tokens": 200, "ignore_eos": True}
DELAY = 0.050  # added to one host's outgoing traffic
LATENCY_SAMPLES = 16  # first tokens per host in each phase of the latency test: medians of 10 proved noisy
SLOW = "w2"  # the host whose outgoing traffic the latency test delays
STALE_AFTER = 3 * HEARTBEAT_INTERVAL  # the coordinator's default stale_after_intervals


def test_requests_spread_over_all_five_hosts(pool: Pool) -> None:
    pool.ensure()
    states = pool.states()
    for worker_id in WORKERS:  # each registered over the bridge, with the address of its own host
        assert states[worker_id]["url"] == f"http://{pool.host(worker_id).address}:{WORKER_PORT}"
    # Ten at once fill the pool's 5 x 2 sessions; the default scoring puts two on each host.
    results = pool.client.run([{**SHORT, "max_tokens": 16}] * 10)
    assert [r.ended for r in results] == ["done"] * 10, [(r.status, r.error_body, r.failure) for r in results]
    for r in results:
        assert r.terminal is not None and r.terminal[1]["worker_id"] == r.worker_id
    served = Counter(r.worker_id for r in results)
    pool.figures["spread"] = dict(sorted(served.items()))
    assert set(served) == set(WORKERS), served


@pytest.mark.solo  # medians of a few milliseconds: another test process's load moves them
def test_latency_on_one_host_shows_in_its_ttft_only(pool: Pool) -> None:
    """Every round asserts that each of the slow host's first tokens was held the delay; the medians'
    comparison, which the machine's load between the two phases can move by itself (a clean-clone CI run
    measured +30 ms for 50 ms, every sample over 50 ms), gets a second round when the first missed it,
    and must hold in one."""
    for attempt in range(1, 3):
        added, shift = _latency_round(pool, attempt)
        if added[SLOW] - shift >= 0.7 * DELAY:
            break
    assert added[SLOW] - shift >= 0.7 * DELAY, pool.figures["latency"]
    for other in sorted(set(WORKERS) - {SLOW}):
        assert added[other] < DELAY / 2, pool.figures["latency"]


def _latency_round(pool: Pool, attempt: int) -> tuple[dict[str, float], float]:
    """One measurement before and during the delay: each host's added network share of TTFT, and what
    the machine's load did to every host between the two phases (the others' median)."""
    pool.ensure()
    baseline = _ttft_by_worker(pool, per_host=LATENCY_SAMPLES)
    with pool.network.delay(pool.host(SLOW), DELAY) as delay:
        delayed = _ttft_by_worker(pool, per_host=LATENCY_SAMPLES)
    # The network's share of TTFT: what the client saw minus the worker's own admission-to-token
    # time, so the two cores' scheduling noise in prefill does not blur the comparison.
    added = {w: _median(delayed[w], "network") - _median(baseline[w], "network") for w in WORKERS}
    # What the machine's load did to every host between the two phases, read off the others: the
    # slow host's share is compared after taking that out.
    shift = statistics.median(added[w] for w in WORKERS if w != SLOW)
    pool.figures["latency"] = {
        "host": SLOW, "delay_ms": DELAY * 1e3, "method": delay.method, "round": attempt,
        "samples_per_host": {w: [len(baseline[w]), len(delayed[w])] for w in WORKERS},
        "ttft_median_ms": {w: {"before": round(_median(baseline[w], "client") * 1e3, 1),
                               "during": round(_median(delayed[w], "client") * 1e3, 1)} for w in WORKERS},
        "network_share_added_ms": {w: round(added[w] * 1e3, 1) for w in WORKERS},
        "others_shift_ms": round(shift * 1e3, 1),
    }
    # Every frame the slow host sends is held DELAY, so each of its first tokens arrived at least
    # that long after the worker made it.
    assert min(s["network"] for s in delayed[SLOW]) >= DELAY, pool.figures["latency"]
    return added, shift


def test_partition_moves_its_streams_sends_new_requests_elsewhere_and_heals(pool: Pool) -> None:
    pool.ensure()
    long = [pool.client.start(LONG) for _ in WORKERS]  # one per host: each takes the least loaded
    _wait_for(lambda: all(s.tokens >= 2 for s in long), 60, "every long stream to be generating", long)
    serving = sorted({str(s.worker_id) for s in long})
    victim = "w3" if "w3" in serving else serving[-1]
    on_victim = [s for s in long if s.worker_id == victim]
    figures: dict[str, Any] = {
        "host": victim, "streams_on_it": len(on_victim),
        "deadlines_s": {"read": READ_TIMEOUT, "first_event": FIRST_EVENT_TIMEOUT, "connect": CONNECT_TIMEOUT,
                        "stale_after": STALE_AFTER}}
    pool.figures["partition"] = figures  # filled in as it goes, so a failure still shows how far it got
    failovers = pool.client.metric("coordinator_failovers_total")

    partitioned_at = time.monotonic()
    pool.network.partition(pool.host(victim))
    # At once, while the coordinator still lists the victim as alive: these may be sent to it first,
    # and must fail over (the connect deadline, or on a kept-alive connection the read deadline, which
    # also covers the response head).
    right_after = [pool.client.start(SHORT) for _ in range(3)]
    # Stale, or already removed (no heartbeat for 6 intervals) if this poll was slow.
    stale_at = _wait_for(lambda: pool.states().get(victim, {}).get("state") != "alive", STALE_AFTER + 10,
                         f"{victim} to go stale", long)
    figures["partition_to_stale_s"] = round(stale_at - partitioned_at, 2)
    right_after = [wait(s, READ_TIMEOUT + 30) for s in right_after]
    figures["right_after_partition"] = {
        "workers": sorted(str(s.worker_id) for s in right_after),
        "seconds": sorted(round(_total(s), 2) for s in right_after),
        "failovers": pool.client.metric("coordinator_failovers_total") - failovers}
    once_stale = pool.client.run([SHORT] * 4)
    figures["once_stale_workers"] = sorted(str(s.worker_id) for s in once_stale)
    for s in long:
        wait(s, READ_TIMEOUT + 30)
    # The pause each of the victim's streams saw: its longest gap between two tokens (the silence until the
    # read deadline, then the prefill on another worker).
    figures["victims_pause_s"] = [round(max(b - a for a, b in itertools.pairwise(
        [at for name, _, at in s.events if name == "token"])), 2) for s in on_victim]
    figures["endings"] = sorted({s.terminal[1].get("finish_reason", s.terminal[0]) for s in on_victim if s.terminal})

    figures["state_before_heal"] = pool.states().get(victim, {}).get("state", "removed")
    healed_at = time.monotonic()
    figures["partition_lasted_s"] = round(healed_at - partitioned_at, 2)
    pool.network.heal(pool.host(victim))
    # It was removed from the registry meanwhile; its next heartbeat registers it anew.
    alive_at = _wait_for(lambda: pool.states().get(victim, {}).get("state") == "alive", 30,
                         f"{victim} to rejoin", long)
    figures["heal_to_alive_s"] = round(alive_at - healed_at, 2)
    rejoin: list[Streamed] = []

    def victim_serves() -> bool:
        wave = pool.client.run([SHORT] * len(WORKERS))
        rejoin.extend(wave)
        return any(r.worker_id == victim and r.ended == "done" for r in wave)

    serving_at = _wait_for(victim_serves, 60, f"{victim} to serve again", long)
    figures["heal_to_serving_s"] = round(serving_at - healed_at, 2)

    everything = [*long, *right_after, *once_stale, *rejoin]
    ended = Counter(s.ended for s in everything)
    figures.update(requests=len(everything), outcomes=dict(ended), lost=ended.get("lost", 0))
    # Nothing admitted is lost: every request got a done, an error event, or an explicit refusal.
    assert figures["lost"] == 0, [(s.worker_id, s.status, s.failure, s.events[-1:]) for s in everything]
    # Every long stream ends whole: the victim's go on on another worker once the coordinator's read
    # deadline finds it silent (docs/reliability.md, "A stream outlives its worker"), the others untouched.
    for s in long:
        # A token event may carry several tokens' text (a UTF-8 character split across them):
        # count generated tokens by the done event's usage, not by events.
        assert s.ended == "done" and s.events[-1][1]["usage"]["completion_tokens"] == LONG["max_tokens"], (
            s.worker_id, s.events[-1:])
    for s in on_victim:
        assert s.events[-1][1]["worker_id"] != victim, s.events[-1:]
    # New requests are served elsewhere, both before and after the coordinator marks the host stale.
    for s in [*right_after, *once_stale]:
        assert s.ended == "done" and s.worker_id != victim, (s.worker_id, s.status, s.error_body, s.events[-1:])


# About 420 tokens of history (a 9.6 MB blob), within the pool's 512-token sessions.
HISTORY = ("Here are some notes on the water cycle. " + "Water evaporates from the sea, rises as vapour, cools "
           "into clouds and falls again as rain on hills and fields. " * 16)
MOVED = 'coordinator_session_moves_total{outcome="moved"}'
SOURCE_FAILED = 'coordinator_session_moves_total{outcome="source_failed"}'
EXPORTED = 'worker_kv_transfers_total{direction="export",outcome="ok"}'
# The draining host's frames are held this long, so its blob takes several round trips (TCP's slow
# start: about ten for 9.6 MB, 2.5 s), while its heartbeats, on a kept-alive connection, still arrive
# within their 0.5 s deadline.
LINE_DELAY = 0.25


def _turn(pool: Pool, session_id: str, prompt: str) -> Streamed:
    return pool.client.run([{"prompt": prompt, "session_id": session_id, "max_tokens": 8, "temperature": 0}])[0]


def _held(turn: Streamed) -> int:
    assert turn.ended == "done" and turn.terminal is not None, (turn.status, turn.error_body, turn.failure)
    usage = turn.terminal[1]["usage"]
    return int(usage["prompt_tokens"]) + int(usage["completion_tokens"])


def test_a_drained_hosts_session_moves_to_another_host(pool: Pool) -> None:
    pool.ensure()
    sid = "mh-moved"
    first = _turn(pool, sid, HISTORY + "Question: where does rain come from?")
    held, source = _held(first), str(first.worker_id)
    moved = pool.client.metric(MOVED)
    drained_at = time.monotonic()
    pool.workers[source].popen.send_signal(signal.SIGTERM)  # `ip netns exec` ran the worker in its place
    assert pool.workers[source].popen.wait(timeout=60) == 0, pool.logs()
    figures: dict[str, Any] = {"from": source, "history_tokens": held,
                               "sigterm_to_exit_s": round(time.monotonic() - drained_at, 2)}
    pool.figures["session_move"] = figures
    after = _turn(pool, sid, "And where does it go then?")
    assert after.ended == "done" and after.terminal is not None, (after.status, after.error_body, after.failure)
    figures.update(to=after.worker_id, cached_tokens=after.terminal[1]["usage"]["cached_tokens"],
                   moves=pool.client.metric(MOVED) - moved)
    # Its KV crossed the bridge from one host to another: the next turn is served elsewhere with its
    # history already there (at most the last generated token prefilled again).
    assert after.worker_id != source, figures
    assert figures["cached_tokens"] >= 0.9 * held, figures
    assert figures["moves"] == 1, figures
    assert pool.client.delete(f"/coordinator/sessions/{sid}") == 204
    pool.restart(source)


def test_a_partition_during_a_move_ends_it_on_both_sides(pool: Pool) -> None:
    pool.ensure()
    sid = "mh-cut"
    first = _turn(pool, sid, HISTORY + "Question: what makes clouds?")
    held, source = _held(first), str(first.worker_id)
    host = pool.host(source)
    worker_url = f"http://{host.address}:{WORKER_PORT}"
    exported = pool.client.metric(EXPORTED, worker_url, TOKEN)
    failed, moved = pool.client.metric(SOURCE_FAILED), pool.client.metric(MOVED)
    figures: dict[str, Any] = {"from": source, "history_tokens": held, "line_delay_s": LINE_DELAY}
    pool.figures["partition_during_move"] = figures
    with pool.network.delay(host, LINE_DELAY):
        pool.workers[source].popen.send_signal(signal.SIGTERM)
        # The coordinator sees the drain, lists the sessions and fetches this one's blob; the worker
        # counts an export once the blob is made, and its bytes then crawl out through the delay line.
        def exported_yet() -> bool:
            assert pool.workers[source].running, f"{source} ended before it exported anything:\n{pool.logs()}"
            try:
                return pool.client.metric(EXPORTED, worker_url, TOKEN) > exported
            except httpx.HTTPError:
                return False

        _wait_for(exported_yet, 30, "the draining worker to export the session", [first])
        cut_at = time.monotonic()
        pool.network.isolate(host)
        # The coordinator's side: its fetch ends at the move's deadline, counted, with nothing put anywhere.
        failed_at = _wait_for(lambda: pool.client.metric(SOURCE_FAILED) > failed, 30,
                              "the coordinator to give the move up", [first])
        figures["cut_to_given_up_s"] = round(failed_at - cut_at, 2)
        # The worker's side: its drain ends and it exits, the cut connection notwithstanding.
        assert pool.workers[source].popen.wait(timeout=60) == 0, pool.logs()
        figures["cut_to_exit_s"] = round(time.monotonic() - cut_at, 2)
    pool.network.rejoin(host)
    figures["moved"] = pool.client.metric(MOVED) - moved
    assert figures["moved"] == 0, figures  # the cut came mid-fetch, not after a finished move
    assert figures["cut_to_given_up_s"] < 5 + 5, figures  # the coordinator's --session-move-timeout, and slack
    # The session is said to be lost, as one that could not move is: never silently started afresh.
    after = _turn(pool, sid, "And then?")
    figures["next_turn"] = [after.status, after.error_body]
    assert after.ended == "refused" and after.status == 404, (after.status, after.error_body, after.events[-1:])
    assert after.error_body is not None and after.error_body["reason"] in ("unknown_session", "session_expired")
    # Nothing half-imported anywhere: once the host is back, every worker holds no session (ensure()).
    pool.restart(source)


def _ttft_by_worker(pool: Pool, per_host: int = 10, max_waves: int = 80) -> dict[str, list[dict[str, float]]]:
    """Waves of five concurrent requests (mostly one per host, as each takes the least loaded host)
    until every host has `per_host` samples. The five are sent at once, and the coordinator counts each
    in flight from its admission, so they spread however short they are; a wave that does not only
    adds a wave. Every token after the first is decoding the measure does not need."""
    samples: dict[str, list[dict[str, float]]] = defaultdict(list)
    for _ in range(max_waves):
        for r in pool.client.run([SHORT] * len(WORKERS)):
            assert r.ended == "done", (r.status, r.error_body, r.failure, r.events[-1:])
            assert r.ttft is not None and r.worker_ttft is not None and r.worker_id is not None
            samples[r.worker_id].append({"client": r.ttft, "network": r.ttft - r.worker_ttft})
        if all(len(samples[w]) >= per_host for w in WORKERS):
            return samples
    raise AssertionError(f"fewer than {per_host} samples per host after {max_waves} waves: "
                         f"{ {w: len(samples[w]) for w in WORKERS} }")


def _median(samples: list[dict[str, float]], key: str) -> float:
    return round(statistics.median(s[key] for s in samples), 4)


def _total(s: Streamed) -> float:
    return (s.terminal[2] if s.terminal else time.monotonic()) - s.sent_at


def _wait_for(check: Any, timeout: float, what: str, streams: list[Streamed]) -> float:
    """Polls `check` until true; returns the time it first was."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return time.monotonic()
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout:g} s waiting for {what}; streams: "
                         f"{[(s.worker_id, s.tokens, s.ended) for s in streams]}")
