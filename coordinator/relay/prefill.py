"""Disaggregated prefill: a long prompt prefilled on one worker, its tokens decoded on another.

Owns: the prefill step of that routing option (`DISAGGREGATE_PROMPT_BYTES`). The prompt goes first to
the prefill worker as a one-token request; its cells stay there as the prompt cache's leftover. The
request itself then goes to the decode workers with that worker named as its `prefix_peer`, so the
one it lands on fetches the prompt's cells (`POST /worker/prefix`) instead of prefilling them, and
prefills only what is left. Every step is an ordinary request: admitted, reserved (by whoever opens
it), bounded by the dispatcher's deadlines and released however it ends.
Must not: decide when to disaggregate or rank workers (gateway.py and the policy do), or fail the
request: a prefill that does not finish leaves the prompt to the decode worker, as without the option.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
from collections.abc import Awaitable, Callable, Sequence

from coordinator.errors import CoordinatorError
from coordinator.generation import Generation
from coordinator.pool.registry import WorkerRecord
from coordinator.relay.dispatch import OpenStream, PrefixPeer
from coordinator.upstream import WorkerStreamError
from protocol.worker import EVENT_DONE, EVENT_ERROR

log = logging.getLogger("coordinator.requests")
Opens = Callable[[Generation, Sequence[WorkerRecord]], Awaitable[OpenStream]]
ENDS = (EVENT_DONE, EVENT_ERROR)


def prefill_part(gen: Generation) -> Generation:
    """The request as its prefill worker gets it: the same prompt, one token, one-shot."""
    request = gen.request.model_copy(update={"max_tokens": 1, "n": 1})
    payload = json.loads(gen.payload)
    payload["max_tokens"] = 1
    payload.pop("n", None)
    demand = dataclasses.replace(gen.demand, max_tokens=1, choices=1)
    return dataclasses.replace(gen, request=request, payload=json.dumps(payload).encode(), demand=demand)


async def prefill_on(worker: WorkerRecord, gen: Generation, opens: Opens, release: Callable[[OpenStream], None], *,
                     read_timeout: float) -> PrefixPeer | None:
    """Prefills `gen`'s prompt on `worker`; the peer the decode worker fetches the cells from, or None
    when the prefill did not finish (the decode worker then prefills the prompt itself). `opens`
    starts the prefill request on the workers given (coordinator/attempts.py, reserving it), and
    `release` gives its reservation back once it is read. After the first event (the dispatcher's
    deadline), the rest of its short stream has `read_timeout`."""
    reason = "stream_ended"
    try:
        stream = await opens(prefill_part(gen), [worker])
    except CoordinatorError as exc:
        stream, reason = None, exc.reason
    if stream is not None:
        try:
            async with asyncio.timeout(read_timeout):
                last = stream.first
                if last.event not in ENDS:
                    async for last in stream.events:  # one token, then its end
                        if last.event in ENDS:
                            break
            if last.event == EVENT_DONE:
                return PrefixPeer(worker.worker_id, worker.url, 1.0, {worker.worker_id: 1.0})
        except (WorkerStreamError, TimeoutError):
            pass
        finally:
            await stream.close()
            release(stream)
    log.warning(json.dumps({"event": "prefill_failed", "request_id": gen.request_id, "worker_id": worker.worker_id,
                            "reason": reason}))
    return None
