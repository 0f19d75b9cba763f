"""Mutation check: break each property the coordinator claims, once, and prove its tests fail.

Owns: the table of mutations (the property each breaks, the exact source text it replaces, and the
tests that must catch it) and running them, each in a scratch copy of the repository.
Must not: touch the working tree, which others edit while this runs: the sources are copied once into
a temporary folder, and each mutation is applied to its own copy of that snapshot.

A mutation is *killed* when its tests fail (pytest exits 1) and *survives* when they pass; any other
ending (a collection error, a usage error, a time-out) is an error, never a kill: a mutation that only
breaks imports proves nothing about the property. A mutation whose text is not found exactly once is
an error too: the table has gone stale, and it says so rather than passing in silence. The tests run
first on the unmutated snapshot, where they must pass.

Usage: .venv/bin/python scripts/mutations.py [--list] [--jobs N] [NAME ...]
Exit status 0 only when every mutation chosen was killed; 2 when the unmutated tests fail.
--jobs N runs N mutations at a time, each in its own copy. One at a time by default: on the 2-core
machine two at once timed out (TIMEOUT) on 3 of 6 mutations whose tests run the model or a pool
(2026-11-29; an in-process model there takes two llama.cpp threads, tests/conftest.py), though most
mutations' runs are one core's pytest start-up and imports.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# What pytest needs to run the coordinator's tests (tests/conftest.py imports bench and worker too).
SOURCES = ("coordinator", "worker", "protocol", "serving", "bench", "client", "tests", "pyproject.toml")
PYTEST_FLAGS = ("-x", "-q", "-p", "no:cacheprovider", "-p", "mutation_guard")
TIMEOUT = 60.0  # seconds per pytest run: a mutation that hangs a test is an error, not a kill
# The unmutated run takes every mutation's tests at once (each mutation runs only its own).
UNMUTATED_TIMEOUT = 240.0
JOBS = 1  # mutations run at once (--jobs; see the module's docstring)
# Loaded by every pytest run (-p): refuses to run unless the snapshot's packages are the ones imported,
# since the project is installed editable into .venv and would otherwise shadow the copy.
GUARD = '''\
import pathlib

import pytest


def pytest_configure(config):
    import coordinator, protocol, worker

    root = pathlib.Path(__file__).resolve().parent
    for module in (coordinator, protocol, worker):
        if root not in pathlib.Path(module.__file__).resolve().parents:
            raise pytest.UsageError(f"{module.__name__} imported from {module.__file__}, not {root}")
'''

ADMISSION = "coordinator/admission/capacity.py"
REGISTRY = "coordinator/pool/registry.py"
QUEUE = "coordinator/admission/queue.py"
POLICY = "coordinator/scheduling/policy.py"
BREAKER = "coordinator/pool/breaker.py"
T_ADMISSION = "tests/coordinator/admission/test_capacity.py"
T_SCORING = "tests/worker/backends/test_prompt_scoring.py"
T_REGISTRY = "tests/coordinator/pool/test_registry.py"
T_QUEUE = "tests/coordinator/admission/test_queue.py"
T_BUFFER = "tests/coordinator/relay/test_buffer.py"
T_BREAKER = "tests/coordinator/pool/test_breaker.py"
T_POLICY = "tests/coordinator/scheduling/test_policy.py"
T_UNITS = "tests/coordinator/scheduling/test_units.py"
T_AFFINITY = "tests/coordinator/affinity/test_property_affinity.py"
T_TENANCY = "tests/coordinator/test_tenancy.py"
T_SUPERVISION = "tests/coordinator/relay/test_supervisor.py"
T_EMBEDDING_ADMISSION = "tests/coordinator/admission/test_embeddings.py"
T_EMBEDDINGS = "tests/coordinator/test_surface_embeddings.py"
T_SIMULATED = "tests/worker/backends/test_simulated.py"
T_JOINING = "tests/integration/test_joining_the_port.py"
T_CONTINUATION = "tests/worker/backends/test_continuation.py"
T_CONTINUATION_API = "tests/worker/api/test_continuation.py"
T_CONTINUED_SAMPLING = "tests/worker/engine/test_continued_sampling.py"
CHECK_SUMS = "        totals = self._registry.totals(model)\n"


@dataclass(frozen=True)
class Mutation:
    name: str
    breaks: str  # the property it breaks, in one line
    path: str  # relative to the repository root
    old: str  # found exactly once in `path`
    new: str
    tests: tuple[str, ...]  # files or node ids, at least one of which must fail

    def apply(self, source: str) -> str:
        found = source.count(self.old)
        if found != 1:
            raise StaleMutation(f"{self.name}: its text is found {found} times in {self.path}, not once: "
                                f"the table is stale\n    {self.old!r}")
        return source.replace(self.old, self.new)


class StaleMutation(Exception):
    """A mutation's source text is not in its file exactly once."""


def loop_in_check(walk: str) -> str:
    """Admission's check with a loop over workers in front of its O(1) read of the sums."""
    return f"        for _worker in {walk}:\n            pass\n" + CHECK_SUMS


MUTATIONS: tuple[Mutation, ...] = (
    Mutation("admission-loops-alive", "admission's check is O(1): it never walks the alive workers",
             ADMISSION, CHECK_SUMS, loop_in_check("self._registry.alive()"), (T_ADMISSION,)),
    Mutation("admission-loops-all", "admission's check is O(1): it never walks every known worker",
             ADMISSION, CHECK_SUMS, loop_in_check("self._registry.all()"), (T_ADMISSION,)),
    Mutation("admission-loops-dict", "admission's check is O(1): it never walks the registry's own dict",
             ADMISSION, CHECK_SUMS, loop_in_check("self._registry._workers.values()"), (T_ADMISSION,)),
    Mutation("admission-kv-off-by-one", "admission admits a request whose KV need equals the free KV",
             ADMISSION, "if totals.free_kv_bytes < need and not parking:",
             "if totals.free_kv_bytes <= need and not parking:", (T_ADMISSION,)),
    Mutation("release-keeps-correction", "a released reservation stops counting against its worker",
             ADMISSION, "self._registry.end(res.worker_id, res.key, self._clock.time(), kept_kv_bytes=kept)",
             "pass", (T_ADMISSION,)),
    Mutation("release-twice", "releasing a reservation is idempotent (every ending may call it)",
             ADMISSION, "        if res.released:\n            return\n", "", (T_ADMISSION,)),
    Mutation("registry-stale-keeps-totals", "a worker that goes stale leaves the alive sums",
             REGISTRY, "        self._count(rec, -1)\n        del self._alive[rec.worker_id]\n",
             "        del self._alive[rec.worker_id]\n", (T_REGISTRY,)),
    Mutation("registry-remove-keeps-totals", "a removed worker leaves the alive set and the sums",
             REGISTRY, "        self._leave(rec)\n        self._stale.pop(worker_id, None)\n",
             "        self._stale.pop(worker_id, None)\n", (T_REGISTRY,)),
    Mutation("queue-bound-off-by-one", "a model's queue holds at most `size` waiters of a tenant (size + 1 is refused)",
             QUEUE, "if line is not None and len(line) >= self.size:", "if line is not None and len(line) > self.size:",
             (T_QUEUE,)),
    Mutation("queue-timeout-ignored", "a queued request waits no longer than its deadline",
             QUEUE, "timeout=max(0.0, deadline - now())", "timeout=None", (T_QUEUE,)),
    Mutation("queue-lifo", "each line of the queue is FIFO: the first to join is the first woken",
             QUEUE, "            line.append(waiter)\n", "            line.appendleft(waiter)\n", (T_QUEUE,)),
    Mutation("load-not-waited-for", "a request for a model being loaded waits for it in the queue's line",
             "coordinator/admission/waiting.py", "return exc.reason in POOL_CHANGING and (", "return False and (",
             ("tests/coordinator/test_gateway_waits.py",)),
    Mutation("offers-not-woken", "a heartbeat wakes the requests waiting for a model its worker offers",
             "coordinator/ops/health.py", "        state.queue.wake(offer.name)\n", "        pass\n",
             ("tests/coordinator/test_gateway_waits.py",)),
    Mutation("ask-never-answered", "the heartbeat that shows a model served answers its load's ask",
             "coordinator/ops/health.py", "        state.loads.served(record.model)", "        pass",
             ("tests/coordinator/test_gateway_waits.py",)),
    Mutation("affinity-ignores-model", "a session's worker that now serves another model is not chosen",
             POLICY, "if alive.keep(request, w, now) and model.keep(request, w, now):",
             "if alive.keep(request, w, now):", (T_POLICY, T_AFFINITY)),
    Mutation("affinity-ignores-liveness", "a session's worker that went stale is not chosen",
             POLICY, "if alive.keep(request, w, now) and model.keep(request, w, now):",
             "if model.keep(request, w, now):", (T_POLICY,)),
    Mutation("gateway-drops-model", "placement schedules with the model asked for, so affinity can check it",
             "coordinator/placement.py", "Request(gen.demand, model, body.session_id, leaning.session_worker,",
             "Request(gen.demand, None, body.session_id, leaning.session_worker,", (T_AFFINITY,)),
    Mutation("session-room-off-by-one", "a new session needs a free sequence slot (a full worker is filtered)",
             "coordinator/scheduling/filters/session_room.py",
             "worker.sessions - worker.idle_sessions + need <= worker.max_sessions",
             "worker.sessions - worker.idle_sessions + need < worker.max_sessions", (T_UNITS, T_POLICY)),
    Mutation("session-room-one-per-request", "a request of n choices needs n free sequence slots on one worker",
             "coordinator/scheduling/filters/session_room.py", "need = request.demand.sessions",
             "need = min(1, request.demand.sessions)", (T_UNITS,)),
    Mutation("admission-one-session-per-request", "admission reserves a sequence slot per choice",
             ADMISSION, "demand.sessions and totals.free_sessions < demand.sessions",
             "demand.sessions and totals.free_sessions < 1", (T_ADMISSION,)),
    Mutation("demand-one-choice-of-kv", "a request of n choices reserves KV for each (each holds the prompt)",
             "coordinator/admission/demand.py",
             "return self.choices * min(session_max_tokens, self.prompt_bytes + template + self.max_tokens)",
             "return min(session_max_tokens, self.prompt_bytes + template + self.max_tokens)",
             (T_ADMISSION, T_UNITS)),
    Mutation("kv-room-off-by-one", "a worker with exactly the KV a request needs can take it",
             "coordinator/scheduling/filters/kv_room.py", "+ worker.idle_kv_bytes >= need",
             "+ worker.idle_kv_bytes > need", (T_UNITS, T_POLICY)),
    Mutation("scorer-weight-ignored", "scorers are weighted by the settings (default 0.6 sessions, 0.4 KV)",
             POLICY, "parts = {s.name: weight * s.score(request, worker)",
             "parts = {s.name: s.score(request, worker)", (T_POLICY,)),
    Mutation("breaker-never-opens", "a worker's breaker opens after `threshold` failures in a row",
             BREAKER, "if worker.breaker_probing or worker.breaker_failures >= self.threshold:",
             "if worker.breaker_probing:", (T_BREAKER,)),
    Mutation("breaker-never-half-opens", "once the cool-down has passed, one probe request may go",
             "coordinator/scheduling/filters/breaker_closed.py", "return worker.breaker_open_until <= now and",
             "return worker.breaker_open_until == 0.0 and", (T_UNITS, T_BREAKER)),
    Mutation("breaker-probes-unlimited", "while a probe is in flight no other request goes to that worker",
             BREAKER, "            worker.breaker_probing = True\n", "            pass\n", (T_BREAKER,)),
    Mutation("buffer-unbounded", "the relay buffer holds at most `maxsize` events",
             "coordinator/relay/buffer.py", "        if len(self._items) >= self.maxsize:\n            return False\n",
             "", (T_BUFFER,)),
    # Tenancy: a session id, a conversation and a cached answer belong to the key that made them.
    Mutation("session-key-ignores-tenant", "a session is looked up by (tenant, id), not by id alone",
             "coordinator/generation.py", "return (self.request.tenant, session_id)", "return (\"\", session_id)",
             (T_TENANCY,)),
    Mutation("conversation-ignores-tenant", "conversation affinity is per tenant",
             "coordinator/affinity/conversations.py", 'digest.update(f"{tenant}\\0{model or \'\'}\\0".encode())',
             'digest.update(f"{model or \'\'}\\0".encode())', (T_TENANCY, "tests/coordinator/affinity/test_conversations.py")),
    Mutation("cache-key-ignores-tenant", "a cached answer is never served to another tenant",
             "coordinator/cache.py", 'body = request.model_dump_json(exclude={"model", "keep_alive"})',
             'body = request.model_dump_json(exclude={"model", "keep_alive", "tenant"})', (T_TENANCY,)),
    Mutation("cache-key-ignores-identity", "a model swapped under the same name misses the response cache",
             "coordinator/cache.py", 'f"{surface}\\0{model or \'\'}\\0{identity}\\0{body}"',
             'f"{surface}\\0{model or \'\'}\\0{body}"', ("tests/coordinator/test_cache.py",)),
    Mutation("prompt-bound-ignored", "a prompt longer than any session can hold is refused before tokenizing",
             ADMISSION, "if longest and 0 not in longest and demand.prompt_bytes > max(longest):",
             "if False:", ("tests/coordinator/test_app.py",)),
    Mutation("score-ties-by-id", "score ties go to the worker picked least recently, not to the lowest id",
             "coordinator/scheduling/pickers/score.py", "(scores[w.worker_id], w.picked_at, w.worker_id)",
             "(scores[w.worker_id], w.worker_id)", (T_POLICY,)),
    # The agents' API: nothing meaning-changing dropped, browsers only from the configured origins,
    # grammars and biases applied.
    Mutation("unsupported-field-dropped", "a field the pool does not implement is refused, never dropped",
             "coordinator/surfaces/openai.py", "        if harmless is not None and not harmless(value):",
             "        if False:", ("tests/coordinator/test_surface_openai.py",)),
    Mutation("cors-any-origin", "only the configured origins get CORS permission",
             "coordinator/ops/cors.py", 'if origin is None or not (self._any or origin.decode("latin-1") in self._origins):',
             "if origin is None:", ("tests/coordinator/ops/test_cors.py",)),
    Mutation("grammar-ignored", "a constrained row only gets what its grammar allows",
             "worker/engine/sampling.py", "        if request.constraint is not None:\n            token = self._constrained(",
             "        if False:\n            token = self._constrained(",
             ("tests/worker/engine/test_grammar.py::test_a_constrained_row_only_gets_what_its_grammar_allows_and_pays_only_when_it_refuses",)),
    Mutation("logit-bias-ignored", "a logit bias of -100 keeps its token out",
             "worker/engine/sampling.py", "        if self.bias_ids.size:", "        if False:",
             ("tests/worker/engine/test_logit_adjustments.py::test_a_bias_of_minus_100_keeps_a_token_out_greedy_and_sampled",)),
    Mutation("required-call-unconstrained", "a required tool call is held to the functions' schemas",
             "worker/backends/tool_format.py",
             '        return CallConstraint(None, call_schema(tools, several=tools.parallel), lazy=tools.choice == "auto")',
             "        return None",
             ("tests/worker/backends/test_tool_format.py::test_the_generic_format_holds_a_call_to_the_chosen_functions_schemas",)),
    Mutation("kv-digest-unchecked", "a KV blob with a flipped byte is refused before llama.cpp reads it",
             "worker/sessions/transfer.py",
             "    if hashlib.blake2b(cells, digest_size=32).hexdigest() != header.digest:",
             "    if False:", ("tests/worker/sessions/test_transfer.py",)),
    Mutation("responses-call-as-text", "a Responses answer that is a call comes back as function_call items",
             "coordinator/surfaces/responses_format.py",
             "        found = read_calls(text, tools, self.request_id) if tools is not None and tools.calling else None",
             "        found = None", ("tests/coordinator/test_surface_responses_tools.py",)),
    Mutation("socket-chain-dropped", "a WebSocket turn with previous_response_id is prompted with the chain before it",
             "coordinator/surfaces/responses_socket.py",
             "        items = (*chain, *new) if isinstance(new, list) else None",
             "        items = tuple(new) if isinstance(new, list) else None",
             ("tests/coordinator/test_surface_responses_socket.py::test_two_turns_on_one_socket_the_second_continuing_the_first",)),
    Mutation("socket-overlapping-responses", "a WebSocket runs one response at a time",
             "coordinator/surfaces/responses_socket.py",
             "            if self._turn is not None and not self._turn.done():", "            if False:",
             ("tests/coordinator/test_surface_responses_socket.py::test_a_second_create_while_one_runs_gets_an_error",)),
    Mutation("socket-handshake-unchecked", "with keys, a Responses WebSocket's handshake needs one",
             "coordinator/app.py", "        if kind in _CHECKED and not _let_in(scope):",
             '        if kind == "http" and not _let_in(scope):',
             ("tests/coordinator/test_surface_responses_socket.py::test_api_keys_are_checked_on_the_handshake",)),
    Mutation("socket-failed-chain-kept", "a WebSocket continuation that fails forgets the chain it continued",
             "coordinator/surfaces/responses_socket.py",
             "            if previous is not None:\n                self._chains.forget(previous)\n            self._send_error",
             "            self._send_error",
             ("tests/coordinator/test_surface_responses_socket.py::test_a_failed_continuation_forgets_the_chain_it_continued",)),
    Mutation("new-worker-unprobed", "a new worker id is registered only once its URL answers as that worker",
             "coordinator/ops/health.py", "    if _check_identity(state, beat, now):\n        await _prove(state, beat)",
             "    if _check_identity(state, beat, now):\n        pass", ("tests/coordinator/pool/test_heartbeat.py",)),
    Mutation("own-wait-blamed-on-worker", "a request's own wait before `admitted` never opens a worker's breaker",
             "coordinator/relay/dispatch.py", "    if isinstance(exc, TimeoutError) and answered and not started.admitted:",
             "    if False:", ("tests/coordinator/test_app.py",)),
    Mutation("tokenizing-unbounded", "a worker tokenizes a bounded number of prompts at once",
             "worker/admission.py", "        async with self._tokenizing:  # bounded", "        if True:  # bounded",
             ("tests/worker/backends/test_simulated.py",)),
    Mutation("surface-drops-tenant", "the infer surface sends the key's tenant to the worker",
             "coordinator/surfaces/infer.py", '        fields["tenant"] = tenant\n', "        pass\n", (T_TENANCY,)),
    Mutation("metrics-open-with-keys", "with keys, /metrics needs one by default",
             "coordinator/app.py", "and not state.settings.open_metrics", "and state.settings.open_metrics",
             ("tests/coordinator/test_auth.py",)),
    # Supervision: every stream ends, whatever raises, and gives back what it held.
    Mutation("final-callback-unguarded", "a failing final callback still ends the stream",
             "coordinator/relay/stream.py", "        try:\n            on_final(self.outcome)\n        except Exception as exc:",
             "        try:\n            on_final(self.outcome)\n        except ZeroDivisionError as exc:", (T_SUPERVISION,)),
    Mutation("open-leaks-stream", "a fault after dispatch closes the worker request and frees the reservation",
             "coordinator/gateway.py", "            state.admission.release(stream.reservation)\n"
             "            await stream.close()", "            pass", (T_SUPERVISION,)),
    Mutation("collector-fault-unanswered", "a collector's fault answers the client with a 500",
             "coordinator/relay/supervisor.py", "                await self._fail(scope, receive, send)", "                pass",
             (T_SUPERVISION,)),
    Mutation("embeddings-to-any-worker", "embedding requests go only to workers that say they embed",
             "coordinator/scheduling/filters/serves_embeddings.py", "return worker.embedding_capacity > 0",
             "return True", (T_POLICY,)),
    Mutation("embedding-room-off-by-one", "a worker holding as many embedding requests as its capacity is full",
             "coordinator/scheduling/filters/embedding_room.py",
             "worker.embedding_requests < worker.embedding_capacity",
             "worker.embedding_requests <= worker.embedding_capacity", (T_UNITS, T_POLICY, T_EMBEDDINGS)),
    Mutation("embedding-slot-kept", "a released embedding slot is free again", "coordinator/admission/embeddings.py",
             "            self._registry.hold_embedding(slot.worker_id, -1)\n", "            pass\n",
             (T_EMBEDDING_ADMISSION, T_EMBEDDINGS)),
    Mutation("embedding-check-loops", "embedding admission's check is O(1): it never walks the alive workers",
             "coordinator/admission/embeddings.py", CHECK_SUMS, loop_in_check("self._registry.alive()"),
             (T_EMBEDDING_ADMISSION,)),
    Mutation("scattered-sequence-ids", "a new sequence goes next to the running ones (llama.cpp batches consecutive ids)",
             "worker/sessions/table.py", "            if seq_id not in fitting or left.tenant != tenant:",
             "            if left.tenant != tenant:",
             ("tests/worker/sessions/test_table.py::test_sequence_ids_are_handed_out_next_to_running_ones_so_batches_stay_contiguous",)),
    Mutation("top-k-tail-dropped", "top-k side by side also considers the tokens past the last whole group",
             "worker/engine/sampling.py", "    if TOP_K_GROUPS * g < n_vocab:  # the tail", "    if False:  # the tail",
             ("tests/worker/engine/test_sampling.py::test_top_k_rows_is_the_exact_top_k_of_every_row",)),
    Mutation("top-k-max-after-bans", "a row drawn side by side gives its raw maximum, banned tokens included",
             "worker/engine/sampling.py", "    return ids, kept, tops", "    return ids, kept, kept[:, 0]",
             ("tests/worker/engine/test_sampling.py::test_top_k_rows_is_the_exact_top_k_of_every_row",)),
    Mutation("top-k-minus-zero-apart", "-0.0 ties with 0.0 in top-k's order, the lower token first",
             "worker/engine/sampling.py", "values = flat.take(candidates + starts) + np.float32(0.0)",
             "values = flat.take(candidates + starts)",
             ("tests/worker/engine/test_sampling.py::test_top_k_rows_is_the_exact_top_k_of_every_row",)),
    Mutation("lazy-grammar-always-wakes", "a lazy grammar leaves an answer free when its first word is not what it accepts",
             "worker/engine/grammar.py", 'self.state = "holding" if self._grammar.allows(token) else "free"',
             'self.state = "holding"',
             ("tests/worker/engine/test_grammar.py::test_a_lazy_grammar_holds_only_an_answer_that_starts_as_it_does",)),
    Mutation("repeat-penalty-backwards", "llama.cpp's repetition penalty lowers a recent token's logit, whatever its sign",
             "worker/engine/sampling.py", "np.where(values > 0, values / penalty, values * penalty)",
             "np.where(values > 0, values * penalty, values / penalty)",
             ("tests/worker/engine/test_logit_adjustments.py::test_the_repetition_penalty_is_llama_cpps_over_the_latest_tokens_prompt_included",)),
    Mutation("continuation-forgets-grammar", "a continuation advances its grammar over the tokens generated before",
             "worker/admission.py", "            replay(constraints[0], request.generated)\n", "            pass\n",
             (T_CONTINUATION + "::test_a_json_schema_stream_continues_with_its_grammar_where_it_was",)),
    Mutation("continuation-index-from-zero", "a continuation's first new token is numbered after those generated before",
             "worker/engine/endings.py", "            self.generated = self.job.continued\n", "            pass\n",
             (T_CONTINUATION_API,)),
    Mutation("continuation-usage-as-prompt", "a continuation's earlier tokens count as completion, not as prompt",
             "worker/engine/endings.py", "prompt = job.prompt_length  #", "prompt = len(job.prompt_tokens)  #",
             (T_CONTINUATION_API,)),
    Mutation("ids-cut-inside-a-token", "token ids go out with whole tokens only, so a continuation repeats and loses "
             "nothing", "worker/engine/textstream.py", "                out = self._held.boundary(out)",
             "                pass", ("tests/worker/engine/test_textstream.py",)),
    Mutation("seeded-draws-from-zero", "a seeded continuation draws at its tokens' positions, not from the start",
             "worker/engine/sampling.py", "self.position = len(generated)  #", "self.position = 0  #",
             (T_CONTINUED_SAMPLING,)),
    Mutation("continuation-forgets-penalties", "a continuation's penalties count the tokens generated before",
             "worker/engine/sampling.py", "            for token in generated:\n                self.generated[token]",
             "            for token in ():\n                self.generated[token]", (T_CONTINUED_SAMPLING,)),
    Mutation("cache-failure-propagates", "a failing response cache disables itself instead of failing requests",
             "coordinator/cache.py", "            self._put(key, events, identity)\n        except Exception as exc:",
             "            self._put(key, events, identity)\n        except ZeroDivisionError as exc:", (T_SUPERVISION,)),
    Mutation("room-wait-newcomer-first", "with a room wait, a newcomer waits behind the requests already in line",
             "worker/admission.py", "if place is not None or not (self.room_wait > 0 and self._ahead(request)):",
             "if True:", (T_SIMULATED + "::test_with_a_room_wait_a_newcomer_takes_its_place_behind_the_requests_"
                          "already_waiting",)),
    Mutation("worker-headroom-off", "with fair shares, a worker keeps its last free sequence for a tenant below its "
             "share", "worker/admission.py", "        if (kept := self._kept(request)) is not None:",
             "        if (kept := None) is not None:",
             (T_SIMULATED + "::test_with_fair_shares_the_last_free_sequence_waits_for_the_tenant_below_its_share",)),
    Mutation("continued-session-back-to-failed", "a session's first turn, continued, starts its session where it "
             "goes on, never back on the worker that failed", "coordinator/affinity/placement.py",
             "        return None if worker is not None and worker in gen.avoid else worker",
             "        return worker",
             ("tests/coordinator/relay/test_continuation.py::"
              + "test_a_sessions_first_turn_goes_on_on_another_worker_and_its_session_lives_there",)),
    Mutation("kept-leftover-taken-first", "a kept leftover (cache_control) is the last free sequence reused",
             "worker/sessions/table.py", "            best = min(empty) if empty else self._oldest_unkept(fitting)",
             "            best = min(empty) if empty else next(i for i in self._leftover if i in fitting)",
             ("tests/worker/sessions/test_table.py::test_a_kept_leftover_is_the_last_free_sequence_taken_and_its_"
              + "tenant_still_reuses_it",)),
    Mutation("host-cache-any-tenant", "cells saved to host memory serve only their own tenant",
             "worker/sessions/host_cache.py",
             "            if entry.tenant != tenant or len(entry.tokens) < at_least or entry.tokens[0] != prompt[0]:",
             "            if len(entry.tokens) < at_least or entry.tokens[0] != prompt[0]:",
             ("tests/worker/sessions/test_host_cache.py::test_the_longest_prefix_of_the_tenants_own_entries_and_at_"
              + "least_asked",
              "tests/worker/backends/test_host_cache.py::test_a_tenants_leftover_taken_by_another_comes_back_from_"
              + "host_memory")),
    Mutation("cut-step-not-put-back", "the rows a cut step carried go in again, from where they were",
             "worker/backends/llama_engine.py", "            del run.session.tokens[length:]\n",
             "            pass\n",
             ("tests/worker/backends/test_step_cut.py::test_interactive_requests_cut_batch_steps_and_the_batch_"
              + "output_is_unchanged",)),
    Mutation("batch-share-ignored", "batch rows join a step beside interactive ones only as their share allows",
             "worker/backends/llama_engine.py", "        sit_out = urgent or not self.share.admits(",
             "        sit_out = urgent or False and self.share.admits(",
             ("tests/worker/backends/test_step_cut.py::test_at_slowdown_one_batch_rows_sit_out_while_an_interactive_"
              + "stream_decodes",)),
    Mutation("room-beat-off", "with several coordinators, a full worker that frees a sequence beats to all at once",
             "worker/runtime.py", "if s.room_wait_seconds > 0:  # several coordinators",
             "if False:  # several coordinators",
             (T_SIMULATED + "::test_with_several_coordinators_a_freed_sequence_of_a_full_worker_is_beaten_to_all_at_"
                            "once",)),
    Mutation("join-port-at-once", "a coordinator sharing a port joins it only once it knows the pool",
             "coordinator/server.py", "        await self._readiness().until_known()\n",
             "        pass  # joins at once\n",
             (T_JOINING + "::test_a_restarted_coordinator_takes_no_connection_before_it_knows_the_pool",)),
    Mutation("stay-on-port-when-draining", "a draining coordinator sharing a port leaves it at once",
             "coordinator/server.py", "        self._left = True\n", "        self._left = True\n        return\n",
             (T_JOINING + "::test_a_draining_coordinator_leaves_the_port_and_a_rolling_restart_refuses_nothing",)),
    Mutation("ready-without-the-pool-count", "a restarted coordinator is ready once it has as many workers as "
             "the pool counts", "coordinator/pool/readiness.py", "self._workers() >= max(1, self._pool)",
             "self._workers() >= 1", ("tests/coordinator/pool/test_readiness.py",)),
    Mutation("prefill-unpaced", "beside decoding sequences a long prompt's chunk goes in only once they are "
             "owed no time", "worker/backends/llama_engine.py", "and not self.pace.admits(decoding + finishing)",
             "and False", ("tests/worker/backends/test_prefill_pace.py",)),
    Mutation("prefill-pay-after", "a chunk beside decoding is paid for in advance",
             "worker/engine/pacing.py", "return self.debt + self._cost() <= 0", "return self.debt <= 0",
             ("tests/worker/engine/test_pacing.py",)),
    Mutation("prefill-join-unowed", "a sequence that joins the decoding rows is owed the step it waited out",
             "worker/engine/pacing.py", "self.debt = max(self.debt, held)", "self.debt = self.debt",
             ("tests/worker/engine/test_pacing.py",)),
    Mutation("prefill-join-untold", "the engine names the sequences a step's prompts join to the decoding rows",
             "worker/backends/llama_engine.py", "joining=len(rows) - decoding)", "joining=0)",
             ("tests/worker/backends/test_prefill_pace.py::test_the_engine_tells_the_pace_who_joins_and_when_it_idles",)),
    Mutation("grammar-budget-off", "a grammar past the worker's budget is refused before it takes a sequence",
             "worker/engine/grammar.py", "if len(text.encode()) > self._max_bytes:", "if False:",
             (("tests/worker/engine/test_grammar.py::test_a_grammar_past_the_budget_is_refused_before_it_takes_a_"
              "sequence"),)),
    Mutation("transfer-body-unbounded", "a KV upload that falls behind its rate frees its transfer slot",
             "worker/api/transfer.py", "blob = await _body_at_rate(request)", "blob = await request.body()",
             (("tests/worker/api/test_kv_transfer.py::test_an_upload_that_never_sends_its_blob_frees_its_slot_after_"
              "the_grace"),)),
    Mutation("blob-ids-unchecked", "an imported blob's token ids must be in the model's vocabulary",
             "worker/sessions/transfer.py", "if origin.n_vocab and", "if False and",
             ("tests/worker/sessions/test_transfer.py",)),
    Mutation("embeddings-unaffordable-taken", "a worker refuses up front an embedding request it cannot finish "
             "within its deadline at its measured rate", "worker/engine/embedder.py",
             "        if self.rate is None:\n            return\n        needs", "        if True:\n            return\n"
             "        needs", ("tests/worker/engine/test_embedder.py",)),
    Mutation("embeddings-deadline-fails-over", "a worker's embedding deadline is a 504, not a failover",
             "coordinator/relay/embeddings.py", "                        raise CoordinatorError(reasons.DEADLINE_EXCEEDED, "
             "f\"worker {worker.worker_id}", "                        raise Failover(reasons.DEADLINE_EXCEEDED, True); "
             "(f\"worker {worker.worker_id}", ("tests/coordinator/test_surface_embeddings.py",)),
    Mutation("moves-give-up-at-once", "a drain's session no worker can take now is tried again until the deadline",
             "coordinator/pool/moves.py", "        return LATER, \"; \".join(causes)\n",
             "        return self._counted(\"no_room\", session, worker_id, \"; \".join(causes)), \"\"\n",
             ("tests/coordinator/pool/test_moves.py",)),
    Mutation("export-refuses-its-own-mover", "the coordinator whose put failed may export the session again",
             "worker/api/transfer.py", "(not mover or taken_by != mover)", "True",
             (("tests/worker/api/test_kv_transfer.py::test_while_draining_the_coordinator_that_took_a_session_may_"
               "export_it_again"),)),
    Mutation("stop-during-load-frees-under-the-thread", "a stop while the model loads waits for the load's thread",
             "worker/runtime.py", "        return await asyncio.shield(running)\n", "        return await running\n",
             ("tests/worker/test_whole.py",)),
    Mutation("tracing-stop-unbounded", "a process's stop waits at most SHUTDOWN_TIMEOUT for its last spans",
             "serving/tracing.py", "        closing.join(timeout)\n", "        closing.join()\n",
             ("tests/serving/test_tracing.py",)),
    Mutation("ratelimit-headers-only-on-429", "every answer of a limited key carries its x-ratelimit-* headers",
             "coordinator/app.py", "        if client is not None and client.limits.any:", "        if False:",
             ("tests/coordinator/test_ratelimit_headers.py",)),
    Mutation("keep-alive-last-tenant-rules", "a tenant's keep_alive never shortens another tenant's stay",
             "worker/sessions/residency.py", "            until = max(until, last + stay)\n",
             "            until = last + stay\n", ("tests/worker/sessions/test_residency.py",)),
    Mutation("leaving-beat-ignored", "a worker's last beat takes it out of the pool at once",
             "coordinator/ops/health.py", "    if beat.leaving:\n", "    if False:\n",
             ("tests/coordinator/pool/test_heartbeat.py",)),
    Mutation("refused-connection-no-verdict", "a worker whose port refuses connections leaves the pool at once",
             "coordinator/upstream.py", "(WorkerRefused if refused else WorkerUnreachable)",
             "(WorkerUnreachable)", ("tests/coordinator/test_upstream.py",)),
    Mutation("worker-token-dropped", "every call to a worker but the probe carries the worker token",
             "coordinator/upstream.py", "exchange(method, url, {**headers, **self._auth}, body",
             "exchange(method, url, headers, body", ("tests/coordinator/test_upstream.py",)),
    Mutation("tries-stop-at-a-failover", "a failover moves on to the next ranked worker, for every kind of request",
             "coordinator/attempts.py", "                failed.add(failover)\n                continue\n",
             "                failed.add(failover)\n                break\n",
             ("tests/coordinator/test_attempts.py", "tests/coordinator/test_tokenizing.py")),
    Mutation("lost-worker-stays", "a refused connection marks the worker stale at once",
             "coordinator/pool/breaker.py", "        self._registry.lost(worker_id, self._now())\n", "        pass\n",
             ("tests/coordinator/pool/test_breaker.py",)),
    Mutation("fair-order-off", "where requests wait, the tenant with the lowest fair-share counter goes next",
             QUEUE, "self._counter: Callable[[str], float] = fair.counter if fair is not None else (lambda _tenant: 0.0)",
             "self._counter: Callable[[str], float] = lambda _tenant: 0.0",
             ("tests/coordinator/admission/test_fairness.py", "tests/coordinator/test_gateway_fairness.py")),
    Mutation("no-lift-on-return", "a tenant returning from idle is lifted to the lowest active counter",
             "coordinator/admission/fairness.py", "        if floor > self.counter(tenant):\n",
             "        if False:\n", ("tests/coordinator/admission/test_fairness.py",)),
    Mutation("tokens-not-charged", "each generated token is charged to its tenant as it is relayed",
             "coordinator/stages/fair_charge.py",
             "entry.on_token = functools.partial(self._fair.charge_output, tenant)", "entry.on_token = None",
             ("tests/coordinator/test_gateway_fairness.py",)),
    Mutation("headroom-off", "a tenant at its share leaves a free sequence per other active tenant",
             ADMISSION, "        if (others and left < others) or ", "        if (False and others and left < others) or ",
             (T_ADMISSION,)),
    Mutation("waiting-elsewhere-ignored", "a tenant at its share defers to one below its share waiting at any coordinator",
             ADMISSION, "for other in fair.waiting(model)", "for other in ()", (T_ADMISSION,)),
    Mutation("rpm-ignored", "a key over its requests a minute gets 429 rate_limited",
             "coordinator/admission/limits.py", "if state.requests is not None and state.requests.refill(now) < 1:",
             "if False:", ("tests/coordinator/admission/test_limits.py",)),
    Mutation("budget-never-resets", "a key's token budget starts again with its next calendar period",
             "coordinator/admission/limits.py", "if limits.budget is not None and now >= state.period_end:",
             "if limits.budget is not None and state.period_end == 0:", ("tests/coordinator/admission/test_limits.py",)),
    Mutation("priority-order-off", "where requests wait, a higher priority class goes first",
             QUEUE, "for rank in sorted(self.next, reverse=True):", "for rank in sorted(self.next):",
             ("tests/coordinator/admission/test_priority.py",)),
    Mutation("worker-line-ignores-tenants", "a worker's line gives a release to the tenant holding the fewest sequences",
             "worker/admission.py", "key=lambda p: running.get(p.tenant, 0) / p.weight)", "key=lambda p: 0)",
             (T_SIMULATED + "::test_within_a_class_a_release_goes_to_the_tenant_holding_the_fewest_sequences_here",)),
    Mutation("interactive-never-parks", "an interactive request refused for capacity parks a batch request",
             "worker/admission.py",
             '        if request.priority == "interactive" and (admitted := await self._park(attempt)) is not None:',
             "        if False and (admitted := await self._park(attempt)) is not None:",
             ("tests/worker/backends/test_parking.py",)),
    Mutation("parked-never-resumes", "a parked request resumes when a sequence is free",
             "worker/backends/llama_engine.py", "        if self._parked:\n            self._resume(touched)\n",
             "        pass\n", ("tests/worker/backends/test_parking.py",)),
    Mutation("others-service-ignored", "each coordinator adds the service the others gave, off the workers' beats",
             "coordinator/admission/fairness.py", "                self.charge_output(tenant, others[1])\n",
             "                pass\n", ("tests/coordinator/admission/test_fairness.py",)),
    Mutation("elsewhere-not-active", "a tenant running on any worker counts as active here",
             "coordinator/admission/fairness.py",
             "                self._lift(tenant)  # back from idle at another coordinator: lifted there too\n"
             "                self._activate(tenant)\n",
             "                pass\n", ("tests/coordinator/admission/test_fairness.py",)),
    Mutation("reach-off", "a worker beats to a coordinator it has not reached within REACH_RETRY",
             "worker/heartbeat.py", "                await self.reach()\n", "                pass\n",
             (("tests/worker/test_heartbeat.py::test_a_coordinator_not_reached_is_beaten_to_again_within_reach_"
              "retry_and_the_others_get_no_extra_beats"),)),
    Mutation("scored-rows-misread", "a scored prompt's rows are read as its own beside other requests' rows",
             "worker/backends/llama_engine.py", "scored.append((len(rows) + len(scored), run, position))",
             "scored.append((len(scored), run, position))", (T_SCORING,)),
    Mutation("scored-prompt-cached", "a scored prompt is prefilled whole, its cached cells (no logits) not reused",
             "worker/admission.py", "            cached = 0  # cells already held have no logits",
             "            pass  # cells already held have no logits", (T_SCORING,)),
    Mutation("offered-model-taken-by-any-name", "a model a worker offers but none serves is refused, never "
             "answered by the default model", "coordinator/pool/models.py",
             "    if requested is not None:\n        _offered(registry, requested)\n",
             "    if False:\n        _offered(registry, requested)\n", ("tests/coordinator/pool/test_models.py",)),
    Mutation("swap-unloads-busy-model", "a swap waits for the streams in flight: it never unloads a busy model",
             "worker/slots/swapper.py", "await asyncio.gather(old.drain(settings.request_timeout), ",
             "await asyncio.gather(old.drain(0.0), ",
             ("tests/integration/test_model_folder.py",)),
    Mutation("stale-model-file-served", "a served model whose file was replaced on disk is loaded again from it",
             "worker/slots/swapper.py", 'return None if there.identity == slot.runtime.model.identity else ("replaced", there)',
             'return None', ("tests/worker/api/test_swap.py",)),
    Mutation("swap-leaves-the-pool", "a worker's heartbeats go on through its swap, so requests for either "
             "model wait for it", "worker/slots/swapper.py",
             "await old.stop(leaving=False)  # its heartbeats go on", "await old.stop()  # its heartbeats go on",
             ("tests/worker/api/test_swap.py",)),
    Mutation("swap-away-before-waiters-served", "a model loaded for waiting requests keeps its worker while "
             "they are let in", "coordinator/pool/loads.py",
             "if self._now() - worker.swap_ended < HOLD:",
             "if False:", ("tests/coordinator/pool/test_loads.py",)),
    Mutation("unload-with-kept-sessions", "a kept session holds its model loaded until its TTL ends it",
             "worker/runtime.py", "if self.jobs or self.table.stats()[0] or", "if self.jobs or",
             ("tests/integration/test_keep_alive.py",)),
    Mutation("request-keep-alive-ignored", "a request's keep_alive lengthens its tenant's stay from then on",
             "worker/api/routes.py", "runtime.asked_keep_alive(body.tenant, body.keep_alive)",
             "pass", ("tests/integration/test_keep_alive.py",)),
    Mutation("swap-keeps-the-runtime-before", "a swap gives the closed runtime's memory back at once, cycles and all",
             "worker/slots/swapper.py", "    gc.collect()\n", "\n", ("tests/worker/api/test_swap.py",)),
    Mutation("second-model-swaps-the-first", "with WORKER_MAX_MODELS > 1 a model loads into a free slot beside "
             "those served, draining none", "worker/slots/swapper.py",
             "while order and (not free and not out or used", "while order and (not out or used",
             ("tests/worker/api/test_swap.py",)),
    Mutation("slots-past-the-memory-budget", "the models loaded at once fit WORKER_MODEL_MEMORY: past it, one makes room",
             "worker/slots/swapper.py", "or used + offer.need_bytes > budget):", "or False):",
             ("tests/worker/api/test_swap.py",)),
    Mutation("load-asked-of-a-worker-that-swaps", "a worker that loads a model beside those it serves is asked "
             "before one that would swap", "coordinator/pool/loads.py", "key=lambda wo: (not wo[1].beside, ",
             "key=lambda wo: (False, ", ("tests/coordinator/pool/test_loads.py",)),
    Mutation("slot-urls-ignored", "a request to <url>/slots/<k>/... is served by slot k's model",
             "worker/api/slots.py", 'if path.startswith(SLOTS_PATH + "/"):', "if False:",
             ("tests/worker/api/test_slots.py",)),
    Mutation("standby-serves-its-model", "a worker in standby serves no model: its model is offered, and loaded "
             "when asked for", "coordinator/pool/registry.py", "if any(not w.standby for w in workers.values()))",
             "if workers)", ("tests/coordinator/pool/test_loads.py",)),
    Mutation("load-asked-per-request", "a burst of requests for a model not loaded makes one load",
             "coordinator/pool/loads.py", "if ask is None or (self._now() >= ask.again_at and not self._failed(ask)):", "if True:",
             ("tests/coordinator/pool/test_loads.py",)),
    Mutation("folder-serves-all-loaded", "a heartbeat lists only the model a worker serves as loaded",
             "worker/models/folder.py",
             "loaded = serving is not None and o.state == \"offered\" and (",
             "loaded = o.state == \"offered\" or (", ("tests/worker/models/test_folder.py",)),
    Mutation("cache-read-without-reuse", "Messages' cache_read_input_tokens are the prompt tokens the worker reused, "
             "not the whole prompt", "coordinator/surfaces/anthropic_format.py",
             "cached = min(u.cached_tokens, u.prompt_tokens)", "cached = u.prompt_tokens",
             ("tests/coordinator/test_surface_anthropic.py",)),
    Mutation("messages-errors-in-openai-shape", "a refusal on /v1/messages, before the route (keys, unknown "
             "paths) and in it, is in Anthropic's error shape", "coordinator/app.py",
             "        return anthropic.error_response\n", "        return openai.error_response\n",
             ("tests/coordinator/test_surface_anthropic.py",)),
    Mutation("chain-turn-away-from-its-kv", "a turn continuing a stored response prefers the worker that ran it "
             "(whose prompt cache holds the conversation)", "coordinator/affinity/placement.py",
             "                          prefer=gen.prefer)", "                          prefer=None)",
             ("tests/coordinator/test_surface_responses_stored.py",)),
    Mutation("stored-response-other-tenant", "a stored response is read only by its tenant", "worker/sessions/records.py",
             "        record = kept.get(response_id) if kept is not None else None",
             "        record = next((k[response_id] for k in self._tenants.values() if response_id in k), None)",
             ("tests/worker/sessions/test_records.py",)),
    Mutation("stored-response-tenant-dropped", "the coordinator asks the workers for the calling key's record only",
             "coordinator/pool/records.py", "?tenant={quote(tenant)}", "?tenant=",
             ("tests/coordinator/test_surface_responses_stored.py",)),
    Mutation("drain-leaves-records", "a draining worker's stored responses move to the other workers",
             "coordinator/ops/health.py", "        state.stored.draining(record)  #", "        pass  #",
             ("tests/coordinator/test_surface_responses_stored.py",)),
    Mutation("output-for-no-call-accepted", "a function_call_output answering no call of the conversation is refused",
             "coordinator/surfaces/responses.py", "    if name is None:\n        raise _invalid(f\"input.{index}.call_id",
             "    if name is None and False:\n        raise _invalid(f\"input.{index}.call_id",
             ("tests/coordinator/test_surface_responses.py",)),
    Mutation("response-end-before-record", "a response's record is kept before its client can read its end",
             "coordinator/surfaces/responses_stored.py",
             "            if not self._settled and self.ready():\n                self._settled = True\n"
             "                await self.settle()\n            await send(message)\n",
             "            await send(message)\n            if not self._settled and self.ready():\n"
             "                self._settled = True\n                await self.settle()\n",
             ("tests/coordinator/test_surface_responses_stored.py",)),
    Mutation("batch-line-not-parked", "a batch's line runs in the batch class, which an interactive request parks",
             "coordinator/surfaces/batches.py", "(priority.HEADER.encode(), priority.BATCH.encode()),",
             "(priority.HEADER.encode(), priority.INTERACTIVE.encode()),", ("tests/coordinator/batches/test_api.py",)),
    Mutation("continuation-resends-tokens", "a continuation is sent exactly the ids its client has: none twice",
             "coordinator/relay/continuation.py", '.extend(covered)',
             '.extend(covered[:1])', ("tests/coordinator/relay/test_continuation.py",)),
    Mutation("choice-continued-with-all-ids", "each choice's continuation is sent that choice's ids, not another's",
             "coordinator/relay/continuation.py", 'ids.setdefault(data.get("choice", 0), [])',
             "ids.setdefault(0, [])", ("tests/coordinator/relay/test_continuation.py",)),
    Mutation("choice-continued-with-the-request-seed", "a seeded request's choice i goes on from choice i's seed",
             "coordinator/generation.py", "update[\"seed\"] = choice_seed(self.request.seed, choice)",
             "update[\"seed\"] = self.request.seed", ("tests/coordinator/relay/test_continuation.py",)),
    Mutation("choice-events-not-relabelled", "a choice's continuation's token events are relabelled with its choice",
             "coordinator/relay/choices.py", "    if choice == 0:\n        return event\n",
             "    return event\n", ("tests/coordinator/relay/test_continuation.py",)),
    Mutation("continuation-back-to-failed-worker", "a continuation never goes back to a worker that failed it",
             "coordinator/affinity/placement.py", "if w.worker_id not in gen.avoid]", "]",
             ("tests/coordinator/relay/test_continuation.py",)),
    Mutation("drain-cuts-instead-of-moving", "a draining worker's streams move to a worker with room",
             "coordinator/ops/health.py", "                relay.stream.move(record.worker_id)",
             "                pass", ("tests/coordinator/relay/test_continuation.py",)),
    Mutation("peer-busy-not-asked-again", "a worker asks a busy peer (503) for a prefix again within the bound",
             "worker/peers.py", "                return BUSY", "                return None",
             ("tests/worker/test_peers.py",)),
    Mutation("worker-prefill-ignores-tenants", "a worker prefills first the prompts of the tenant with the fewest "
             "sequences decoding there for its weight", "worker/engine/line.py",
             "key=lambda s: (decoding[s.job.request.tenant] / s.job.request.tenant_weight, len(s.todo),",
             "key=lambda s: (0, len(s.todo),", ("tests/worker/engine/test_line.py",)),
    Mutation("batch-line-twice-after-restart", "a job taken over after a restart runs only the lines not done",
             "coordinator/batches/store.py", "WHERE batch_id = ? AND done = 0 AND idx > ? ",
             "WHERE batch_id = ? AND idx > ? ", ("tests/coordinator/batches/test_runner.py",)),
    Mutation("batch-file-of-another-tenant", "a key reads only its tenant's files",
             "coordinator/batches/store.py",
             '"SELECT * FROM files WHERE id = ? AND tenant = ?", (file_id, tenant)',
             '"SELECT * FROM files WHERE id = ? AND ? IS NOT NULL", (file_id, tenant)',
             ("tests/coordinator/batches/test_api.py",)),
)


@dataclass(frozen=True)
class Outcome:
    verdict: str  # "killed", "SURVIVED" or "error"
    seconds: float
    detail: str  # the test that killed it, or why it is an error


def snapshot(into: Path) -> Path:
    """The sources pytest needs, copied once from the working tree, plus the import guard (and a link to
    the model, for the mutations whose tests start real workers)."""
    base = into / "snapshot"
    base.mkdir()
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", ".pytest_cache")
    for name in SOURCES:
        src = ROOT / name
        if src.is_dir():
            shutil.copytree(src, base / name, ignore=ignore)
        else:
            shutil.copy2(src, base / name)
    (base / "mutation_guard.py").write_text(GUARD)
    if (ROOT / "modelFiles").is_dir():  # the real-process tests' model, read only: linked, not copied
        (base / "modelFiles").symlink_to(ROOT / "modelFiles", target_is_directory=True)
    return base


def run_pytest(copy: Path, tests: Sequence[str], timeout: float = TIMEOUT) -> tuple[int, str, float]:
    """Run pytest on `tests` in `copy`, with the copy first on the import path: (exit code, output, seconds)."""
    env = {**os.environ, "PYTHONPATH": str(copy), "PYTHONDONTWRITEBYTECODE": "1"}
    started = time.monotonic()
    try:
        result = subprocess.run([sys.executable, "-m", "pytest", *PYTEST_FLAGS, *tests], cwd=copy, env=env,
                              capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout if isinstance(exc.stdout, str) else (exc.stdout or b"").decode(errors="replace")
        return -1, out + f"\ntimed out after {timeout:g} s", time.monotonic() - started
    return result.returncode, result.stdout + result.stderr, time.monotonic() - started


def first_failure(output: str) -> str:
    for line in output.splitlines():
        # "ERROR tests/..." is pytest's summary; "ERROR    logger:file.py:12 ..." a captured log line.
        if line.startswith("FAILED ") or (line.startswith("ERROR ") and line[6:].startswith("tests/")):
            return line.split(" - ", 1)[0].split(" ", 1)[1]
    return "?"


def tail(output: str, lines: int = 15) -> str:
    return "\n".join("    " + line for line in output.rstrip().splitlines()[-lines:])


def run_one(mutation: Mutation, base: Path, scratch: Path) -> Outcome:
    copy = scratch / mutation.name
    shutil.copytree(base, copy)
    target = copy / mutation.path
    started = time.monotonic()
    try:
        target.write_text(mutation.apply(target.read_text()))
    except (StaleMutation, FileNotFoundError) as exc:
        return Outcome("error", time.monotonic() - started, str(exc))
    code, output, seconds = run_pytest(copy, mutation.tests)
    shutil.rmtree(copy, ignore_errors=True)
    if code == 1:
        return Outcome("killed", seconds, f"by {first_failure(output)}")
    if code == 0:
        return Outcome("SURVIVED", seconds, "its tests passed:\n" + tail(output, 3))
    return Outcome("error", seconds, f"pytest exited {code}, which is no verdict:\n" + tail(output))


def chosen(names: Sequence[str]) -> list[Mutation]:
    by_name = {m.name: m for m in MUTATIONS}
    unknown = [n for n in names if n not in by_name]
    if unknown:
        raise SystemExit(f"unknown mutation(s): {', '.join(unknown)} (see --list)")
    return [by_name[n] for n in names] if names else list(MUTATIONS)


def list_table(mutations: Sequence[Mutation]) -> None:
    for m in mutations:
        print(f"{m.name}\n    breaks: {m.breaks}\n    in:     {m.path}\n    caught: {', '.join(m.tests)}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--list", action="store_true", help="print the table and run nothing")
    parser.add_argument("--jobs", type=int, default=JOBS, help=f"mutations run at once (default {JOBS})")
    parser.add_argument("names", nargs="*", metavar="NAME", help="mutations to run (default: all)")
    args = parser.parse_args(argv)
    mutations = chosen(args.names)
    if args.list:
        list_table(mutations)
        return 0
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="mutations-") as tmp:
        scratch = Path(tmp)
        base = snapshot(scratch)
        tests = list(dict.fromkeys(t for m in mutations for t in m.tests))
        code, output, seconds = run_pytest(base, tests, UNMUTATED_TIMEOUT)
        if code != 0:
            print(f"the unmutated tests do not pass (pytest exited {code}): no mutation can be judged\n"
                  + tail(output, 30))
            return 2
        print(f"{'(unmutated)':30} passes   {seconds:5.1f} s  {len(tests)} test files, imported from the copy")
        outcomes = []
        # Each mutation in its own copy; printed in the table's order as each is judged. On an interrupt
        # the ones not started are dropped, and the running ones end within their time-out.
        pool = ThreadPoolExecutor(max(1, args.jobs))
        try:
            judged = [pool.submit(run_one, m, base, scratch) for m in mutations]
            for m, future in zip(mutations, judged, strict=True):
                outcome = future.result()
                outcomes.append(outcome)
                print(f"{m.name:30} {outcome.verdict:8} {outcome.seconds:5.1f} s  {outcome.detail}", flush=True)
        finally:
            pool.shutdown(cancel_futures=True)
    killed = sum(o.verdict == "killed" for o in outcomes)
    failed = len(outcomes) - killed
    if failed:
        print(f"{failed} mutation(s) not killed: a claimed property can break with every test still passing",
              file=sys.stderr)
    print(f"{killed} passed, {failed} failed in {time.monotonic() - started:.1f} s")
    return 0 if failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
