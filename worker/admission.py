"""The edge of the worker: turns a validated `GenerateRequest` into an admitted `Job`, and an
`EmbedRequest` into its vectors, or refuses them.

Owns: the checks that decide the HTTP status before the first byte (`check`: draining, model name,
session state) and those made after it, while the route pings (`prepare`: prompt length against the
session's KV limit, KV and sequence capacity: an `error` event before `admitted`), prompt construction
(the request's chat messages, or its prompt as a user turn after the session's history, rendered
with the model's chat template; or raw text) and the reuse of a session's cached tokens. A session
id is looked up within the request's tenant only (see worker/sessions/table.py, Tenancy). A request
with `n` > 1 choices reserves n sequences, each `min(session limit, prompt + max_tokens)` cells,
all or none, and brings a grammar state per choice. A continuation (`GenerateRequest.generated`) has
the tokens an earlier worker generated prefilled after its prompt, its grammar advanced over them, and
needs the KV of prompt + max_tokens as any request (they are part of max_tokens). An embedding request
passes the same draining and model checks, then whether this worker embeds, and at that size, before
it joins the embedder's bounded queue (worker/engine/embedder.py).
Priority: an interactive request refused for capacity has the engine park a running batch request
(`Preemption`), one at a time while it is refused and one can be parked, and waits in line before
every batch request; a batch request never takes a sequence that a parked one waits for. Within a
class, a release goes to the waiting request whose tenant holds the fewest of this worker's sequences,
then to the first to wait; a newcomer whose tenant holds fewer than every waiting one's tries at once.
Fair shares (`GenerateRequest.fair_share`): an interactive request whose tenant holds its share here or
more is refused the last free sequences, kept for the other tenants active here (worker/headroom.py),
and waits in line (a batch request is not: it is parked when an interactive one needs the room).
Must not: run inference or free KV itself; it hands jobs and frees to the engine in FIFO order.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from protocol import reasons
from protocol.tokens import DetokenizeRequest, TokenizeResponse, TokenizerInfo, TokenizerInfoRequest
from protocol.worker import EmbedRequest, GenerateRequest, TokenizeWork
from worker.backends.base import EngineBackend, KvTransfer, ModelBackend, Preemption, PromptScoring
from worker.backends.chat_template import TemplateRefusal
from worker.engine.channel import TokenChannel
from worker.engine.embedder import Embedded, Embedder
from worker.engine.jobs import ExtraChoice, Job, StreamItem
from worker.engine.sampling import Constraint, replay
from worker.errors import ConstraintError, WorkerError
from worker.headroom import Headroom
from worker.naming import ModelNames
from worker.sessions.messages import Message
from worker.sessions.table import Admission, Session, SessionTable, shared_prefix
from worker.sessions.transfer import TransferRefused, unpack

# Refusals that capacity coming back can lift.
WAITABLE = frozenset({reasons.SESSIONS_FULL, reasons.KV_FULL})


class PeerPrefixes(Protocol):
    """How a worker asks a peer for a prompt prefix's cells (worker/runtime.py: over HTTP, with the
    worker token, bounded in time and size)."""

    min_tokens: int  # a prefix that saves fewer prompt tokens is prefilled here
    timeout: float  # seconds for the peer's answer, and again for writing its cells here

    async def fetch(self, url: str, tokens: list[int], tenant: str, at_least: int,
                    traceparent: str | None = None) -> bytes | None:
        """The peer's blob, or None (it holds no such prefix, it failed, it was too slow). `traceparent`:
        the request's span, which the peer's span continues (W3C trace context)."""


@dataclass(frozen=True, slots=True)
class Ticket:
    """A request past `Gate.check`: what `Gate.prepare` needs to go on."""
    request: GenerateRequest  # with the model's end-of-turn stop added
    known: Session | None  # the session it continues, if any
    turns: int  # that session's turns when checked: another turn meanwhile makes this prompt stale
    traceparent: str | None = None  # the request's span, when traced: a peer's prefix export continues it


@dataclass(eq=False, slots=True)
class _InLine:
    """A request's place in the room-wait line."""
    turn: asyncio.Event
    interactive: bool
    tenant: str
    weight: float = 1.0  # the tenant's fair-share weight (GenerateRequest.tenant_weight)


@dataclass(eq=False)
class Gate:
    model: ModelBackend
    names: ModelNames
    table: SessionTable
    engine: EngineBackend
    stream_buffer: int  # items a request's channel holds
    clock: Callable[[], float]
    embedder: Embedder | None = None  # None: this worker does not serve embeddings
    peers: PeerPrefixes | None = None  # None: a prompt's prefix is never fetched from a peer
    cells: KvTransfer | None = None  # the engine, when its cells can move (the runtime found): else no peer fetch
    preemption: Preemption | None = None  # the engine, when it parks batch requests: else none is parked
    headroom: Headroom | None = None  # the sequences kept for tenants below their share: None, none kept
    draining: bool = False
    swapping: str = ""  # the model a swap loads next (worker/slots/swapper.py): the drain's refusals name the swap
    # A request refused only for capacity that a cancelled stream still holds (its client left; the
    # engine releases it at its next step) waits for that release, this long at most, instead of
    # answering 503: the coordinator freed that capacity in its view the moment it closed the stream,
    # and refusing here made it retry over and over (about 6 refusals a request for 200 early hang-ups).
    ending_wait: float = 1.0
    # A request refused for capacity waits this long for any release (WORKER_ROOM_WAIT): with several
    # coordinators, one's view misses the others' newest streams, and a request that waits here is
    # served in its turn, where a refusal sent it back to a queue that learns of room only at the next
    # heartbeat, after the coordinator whose own stream ended had filled it again.
    room_wait: float = 0.0
    # Prompts tokenized at once (each in a thread off the event loop): the rest wait their turn, so a
    # burst of long prompts cannot take every core from the decode loop.
    tokenize_concurrency: int = 2
    _tokenizing: asyncio.Semaphore = field(init=False, repr=False)
    # Requests refused for capacity, waiting for a release, interactive ones first, then in the order they
    # began to wait: each for its own deadline, and no more of them than requests open (WORKER_MAX_CONNECTIONS).
    _line: list[_InLine] = field(default_factory=list, init=False, repr=False)
    _loop: asyncio.AbstractEventLoop | None = field(default=None, init=False, repr=False)

    async def admit(self, request: GenerateRequest, request_id: str, *, session_expected: bool = False,
                    stream_ref: int | None = None) -> Job:
        """`check` then `prepare`, for callers that answer nothing in between."""
        return await self.prepare(self.check(request, session_expected=session_expected), request_id,
                                  stream_ref=stream_ref)

    def check(self, request: GenerateRequest, *, session_expected: bool = False) -> Ticket:
        """The refusals that need no tokenizing, decided at once (the route's HTTP status).
        `session_expected`: the caller knows this session lives here (the coordinator's affinity), so
        its absence means the conversation was lost (e.g. a restart): 404, never a fresh start."""
        known = self._known_session(request, session_expected)
        if request.n > self.table.limits.max_sessions:
            raise WorkerError(reasons.INVALID_REQUEST, f"n: {request.n} choices need as many sequences; this "
                              f"worker runs {self.table.limits.max_sessions}")
        if request.prompt_logprobs is not None and not isinstance(self.engine, PromptScoring):
            raise WorkerError(reasons.INVALID_REQUEST, "prompt_logprobs: this worker's engine does not score "
                              "prompts")
        if not request.raw and self.model.turn_stop is not None and self.model.turn_stop not in request.stop:
            request = request.model_copy(update={"stop": [*request.stop, self.model.turn_stop]})
        return Ticket(request, known, len(known.messages) if known else 0)

    async def prepare(self, ticket: Ticket, request_id: str, *, stream_ref: int | None = None) -> Job:
        """Tokenize the prompt, reserve its session and KV and hand the job to the engine; or refuse
        (the prompt too long, no capacity, the session taken meanwhile). This can take a while (a long
        prompt, the tokenizers' queue, a cancelled stream's release), so the route answers the response
        head and pings before calling it. `stream_ref`: the coordinator's reference of this stream,
        listed in heartbeats while it runs."""
        request, known = ticket.request, ticket.known
        history = _history(request, known)
        cached_view = list(known.tokens) if known else []
        async with self._tokenizing:  # bounded: many big prompts at once must not take every core
            try:
                tokens, constraints, continued = await asyncio.to_thread(self._prepare_thread, request, history,
                                                                         cached_view)
            except (TemplateRefusal, ConstraintError) as refused:  # e.g. "Conversation roles must alternate"
                raise WorkerError(reasons.INVALID_REQUEST, str(refused)) from None
        earlier = len(request.generated or ())  # a continuation's: in `tokens`, after the prompt, and in max_tokens
        need = self._need(tokens, earlier, request.max_tokens)
        admission = await self._reserve(request, need, tokens, stream_ref)
        session = admission.session
        if known is not None and (session is not known or len(session.messages) != ticket.turns):
            # Another turn ran or the session was deleted while we tokenized: our prompt is stale.
            self.engine.free(admission.freed_seq_ids)
            self._undo(session, keep_kv=session is known)
            raise WorkerError(reasons.SESSION_BUSY, f"session {request.session_id!r} changed meanwhile")
        cached = min(shared_prefix(session.tokens, tokens), len(tokens) - 1)
        if request.prompt_logprobs is not None:
            cached = 0  # cells already held have no logits: a scored prompt is prefilled whole
        elif request.prefix_peer and known is None and self.peers is not None and self.cells is not None:
            try:
                cached = await self._from_peer(request.prefix_peer, request.tenant, session, tokens, cached,
                                               ticket.traceparent)
            except BaseException:  # cancelled (the client left) or a bug: nothing stays reserved
                self.engine.free(admission.freed_seq_ids)
                self._undo(session, keep_kv=False)
                raise
        loop = asyncio.get_running_loop()
        job = Job(request_id=request_id, request=request, session=session, prompt_tokens=tokens,
                  cached_tokens=cached, history=history if not request.raw else [],
                  channel=TokenChannel[StreamItem](loop, self.stream_buffer), admitted_at=self.clock(),
                  constraint=constraints[0],
                  extra_choices=tuple(ExtraChoice(i, extra, constraints[i])
                                      for i, extra in enumerate(admission.extra, start=1)),
                  continued=earlier, continued_text=continued)
        self.engine.submit(job, admission.freed_seq_ids)
        return job

    def _need(self, tokens: list[int], earlier: int, max_tokens: int) -> int:
        """The KV tokens a request needs, `min(session limit, prompt + max_tokens)`; 413 when its `tokens` (the
        prompt, and the `earlier` ones a continuation generated before) leave no room for a token."""
        limit = self.table.limits.session_max_tokens
        if len(tokens) >= limit:
            also = f" with the {earlier} generated before" if earlier else ""
            raise WorkerError(reasons.PROMPT_TOO_LONG,
                              f"prompt is {len(tokens)} tokens{also}; a session holds at most {limit} tokens "
                              "including the output")
        return min(limit, len(tokens) - earlier + max_tokens)

    async def _from_peer(self, url: str, tenant: str, session: Session, tokens: list[int], cached: int,
                         traceparent: str | None = None) -> int:
        """The prompt's prefix from the peer that holds more of it, when that saves at least
        `peers.min_tokens` of prefill: its cells written into this request's new sequence (a refusal,
        a slow peer or a blob that does not land leaves the prefill to this worker). The cached tokens
        then."""
        assert self.peers is not None and self.cells is not None
        wanted = tokens[:-1]  # one prompt token is always decoded here, for the first logits
        if len(wanted) - cached < self.peers.min_tokens:
            return cached
        blob = await self.peers.fetch(url, wanted, tenant, cached + self.peers.min_tokens, traceparent)
        if blob is None:
            return cached
        try:
            header, cells = unpack(blob, self.cells.cells_origin(), max_tokens=self.table.limits.session_max_tokens)
        except TransferRefused:
            return cached
        n = shared_prefix(header.tokens, wanted)
        if n < cached + self.peers.min_tokens:
            return cached
        async with asyncio.timeout(self.peers.timeout):  # past it: undone by prepare, as a client's leaving is
            held = await asyncio.wrap_future(self.cells.import_cells(session.seq_id, cells, keep=n))
        session.tokens[:] = tokens[:held] if held == n else []  # a refused import leaves the sequence empty
        return held if held == n else 0

    def __post_init__(self) -> None:
        self._tokenizing = asyncio.Semaphore(self.tokenize_concurrency)

    async def embed(self, request: EmbedRequest) -> Embedded:
        """The vectors of an embedding request, or its refusal: draining, another model, no embeddings
        here, another size than this model's; then the embedder's own (full, too long, deadline)."""
        self._serving(request.model)
        if self.embedder is None:
            raise WorkerError(reasons.EMBEDDINGS_UNSUPPORTED, "this worker does not serve embeddings "
                              "(started with --no-embeddings, or its engine has none)")
        size = self.embedder.context.dimensions
        if request.dimensions is not None and request.dimensions != size:
            raise WorkerError(reasons.INVALID_REQUEST, f"dimensions: {self.names.name} embeds into {size} "
                              f"dimensions, the only size served")
        return await self.embedder.embed(request.inputs)

    async def tokenize(self, work: TokenizeWork) -> TokenizeResponse:
        """A prompt's tokens, or a conversation's as a generation's prompt would have them (the model's
        template, the assistant's turn opened); 400 when the template refuses the conversation. Off the
        event loop, among the prompts being tokenized (`tokenize_concurrency`)."""
        self._serving(work.model)
        async with self._tokenizing:
            return await asyncio.to_thread(self._tokenize_thread, work)

    def _tokenize_thread(self, work: TokenizeWork) -> TokenizeResponse:
        if work.prompt is not None:
            tokens = self.model.tokenize(work.prompt, add_special=work.add_special)
        else:
            assert work.messages is not None
            history = [Message(m.role, m.content, m.tool_calls, m.name) for m in work.messages]
            try:
                tokens = self.model.tokenize(self.model.render_chat(history), add_special=work.add_special)
            except TemplateRefusal as refused:
                raise WorkerError(reasons.INVALID_REQUEST, str(refused)) from None
        strs = [self.model.piece(t).decode("utf-8", errors="replace") for t in tokens] if work.token_strs else None
        return TokenizeResponse(count=len(tokens), max_model_len=self.table.limits.session_max_tokens, tokens=tokens,
                                token_strs=strs)

    def tokenizer_info(self, request: TokenizerInfoRequest) -> TokenizerInfo:
        """The model's tokenizer facts (its special tokens, template, limits)."""
        self._serving(request.model)
        special = self.model.special_tokens()
        return TokenizerInfo(tokenizer_class=f"llama.cpp/{special.kind}", bos_token=special.bos,
                             eos_token=special.eos, add_bos_token=special.add_bos,
                             chat_template=special.chat_template,
                             model_max_length=self.table.limits.session_max_tokens,
                             vocab_size=self.model.shape.n_vocab)

    async def detokenize(self, request: DetokenizeRequest) -> str:
        """The tokens' text; 400 naming the first id that is not in the model's vocabulary."""
        self._serving(request.model)
        return await asyncio.to_thread(self._detokenize_thread, request)

    def _detokenize_thread(self, request: DetokenizeRequest) -> str:
        self._in_vocabulary(request.tokens, "tokens")
        return b"".join(self.model.piece(t) for t in request.tokens).decode("utf-8", errors="replace")

    def _in_vocabulary(self, tokens: list[int], field: str) -> None:
        """400 naming the first token id (`field.i`) outside the model's vocabulary."""
        vocabulary = self.model.shape.n_vocab
        for i, token in enumerate(tokens):
            if token >= vocabulary:
                raise WorkerError(reasons.INVALID_REQUEST, f"{field}.{i}: {token} is not a token of "
                                  f"{self.names.name} (its vocabulary has {vocabulary})")

    def ended(self, request: GenerateRequest) -> None:
        """A request admitted here ended: its tenant stays active for the headroom a while longer."""
        self._seen(request)

    def _seen(self, request: GenerateRequest) -> None:
        """An interactive request's tenant is active here for the headroom (a batch tenant's requests fill
        what is idle: no room is kept for them)."""
        if self.headroom is not None and request.fair_share and request.priority == "interactive":
            self.headroom.seen(request.tenant, request.tenant_weight)

    def released(self) -> None:
        """Any thread (the engine's): a session was released; the first request in line tries again."""
        loop = self._loop
        if self._line and loop is not None:
            loop.call_soon_threadsafe(self._wake_first)

    def _wake_first(self) -> None:
        if self._line:
            self._first().turn.set()

    def _first(self) -> _InLine:
        """Who goes next: of the highest class waiting, the request whose tenant holds the fewest of this
        worker's sequences for its weight (a share between tenants, whichever coordinators sent them),
        then the first to wait. O(line + sequences)."""
        interactive = self._line[0].interactive  # the line keeps interactive requests first
        running = self.table.running_by_tenant()
        return min((p for p in self._line if p.interactive == interactive),
                   key=lambda p: running.get(p.tenant, 0) / p.weight)

    async def _reserve(self, request: GenerateRequest, need: int, tokens: list[int],
                       stream_ref: int | None) -> Admission:
        """The table's admission; while it refuses for capacity, the request waits in line for a
        release and tries again in its turn: up to `ending_wait` while cancelled streams still hold
        capacity, up to `room_wait` in any case. A release wakes the one that goes next (`_first`);
        one that is admitted or leaves wakes the next. With a room wait (several coordinators), a request that
        finds others in line takes its place behind them instead of trying first: it was most likely
        sent by the coordinator whose own stream had just ended, and the others came before it."""
        loop = self._loop = asyncio.get_running_loop()
        started = loop.time()
        interactive = request.priority == "interactive"
        self._seen(request)

        def attempt() -> Admission:
            return self.table.admit(request.session_id, need, tokens, tenant=request.tenant, stream_ref=stream_ref,
                                    choices=request.n, prefix_blocks=tuple(request.prefix_blocks or ()),
                                    yields=not interactive, keep=request.cache_keep or 0.0)
        place: _InLine | None = None
        refused: WorkerError | None = None
        try:
            while True:
                if place is not None:
                    place.turn.clear()  # before the attempt: a release after it is not missed
                if place is not None or not (self.room_wait > 0 and self._ahead(request)):
                    tried = await self._try(attempt, request)
                    if isinstance(tried, Admission):
                        return tried
                    refused = tried
                limit = max(self.room_wait, self.ending_wait if self.table.ending else 0.0)
                left = started + limit - loop.time()
                if left <= 0 and refused is not None:
                    raise refused
                if place is None:
                    place = self._join(interactive, request.tenant, request.tenant_weight)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(place.turn.wait(), max(left, 0.0))
        finally:
            if place is not None:
                self._line.remove(place)
                self._wake_first()  # there may be room for the next one too (a spurious wake only retries)

    async def _try(self, attempt: Callable[[], Admission], request: GenerateRequest) -> Admission | WorkerError:
        """The admission, or the capacity refusal to wait on (another refusal is raised); an interactive
        request refused has batch requests parked for it first (`_park`). One whose tenant the headroom
        refuses waits: it is not short of capacity, so nothing is parked for it."""
        if (kept := self._kept(request)) is not None:
            return kept
        try:
            return attempt()
        except WorkerError as exc:
            if exc.reason not in WAITABLE:
                raise
            refused = exc
        if request.priority == "interactive" and (admitted := await self._park(attempt)) is not None:
            return admitted
        return refused

    def _kept(self, request: GenerateRequest) -> WorkerError | None:
        """The refusal when the free sequences are kept for other tenants (worker/headroom.py). Never for a
        batch request: it fills what is idle, and an interactive request parks it when it needs the room."""
        if self.headroom is None or not request.fair_share or request.priority != "interactive":
            return None
        if not self.headroom.keeps(request.tenant, request.tenant_weight, request.n, self.table.running_by_tenant(),
                                   (p.tenant for p in self._line if p.interactive)):
            return None
        return WorkerError(reasons.SESSIONS_FULL, "the last free sequences are kept for other tenants: this "
                           "request's tenant holds its share of this worker's sequences or more")

    def _ahead(self, request: GenerateRequest) -> bool:
        """Whether a request finds others in line that go before it (`_first`'s order): of a higher class,
        or of its class and a tenant holding no more of this worker's sequences for its weight. Any, for a
        batch request."""
        if not self._line:
            return False
        if request.priority != "interactive":
            return True
        if not self._line[0].interactive:
            return False
        running = self.table.running_by_tenant()
        mine = running.get(request.tenant, 0) / request.tenant_weight
        return any(p.interactive and running.get(p.tenant, 0) / p.weight <= mine for p in self._line)

    def _join(self, interactive: bool, tenant: str, weight: float = 1.0) -> _InLine:
        """A place in line: behind every request of its class or above, before every one below."""
        place = _InLine(asyncio.Event(), interactive, tenant, weight)
        at = len(self._line)
        if interactive:
            at = next((i for i, other in enumerate(self._line) if not other.interactive), at)
        self._line.insert(at, place)
        return place

    async def _park(self, attempt: Callable[[], Admission]) -> Admission | None:
        """For an interactive request refused for capacity: the engine parks running batch requests, one
        at a time, and tries the admission after each until it is admitted (its admission) or none is left
        to park (None). A refusal of another kind is raised."""
        while self.preemption is not None and self.preemption.parkable > 0:
            try:
                admitted = await asyncio.wrap_future(self.preemption.park(attempt))
            except WorkerError as exc:
                if exc.reason not in WAITABLE:
                    raise
                continue  # one parked was not enough (KV): park another
            return admitted
        return None

    def _known_session(self, request: GenerateRequest, session_expected: bool) -> Session | None:
        """The session this request continues, if any, after the refusals that need no tokenizing."""
        self._serving(request.model)
        if not request.session_id:
            return None
        # Without the coordinator's claim that it continues here, an expired id starts afresh.
        known = self.table.lookup(request.session_id, tenant=request.tenant, continuation=session_expected)
        if known is None and session_expected:
            raise WorkerError(reasons.UNKNOWN_SESSION,
                              f"session {request.session_id!r} is not on this worker (restarted or dropped)")
        if known is not None and known.busy:
            raise WorkerError(reasons.SESSION_BUSY, f"session {request.session_id!r} is generating")
        return known

    def _serving(self, model: str | None) -> None:
        """Refuses any request while draining, and one for another model than this worker's."""
        if self.draining and self.swapping:
            raise WorkerError(reasons.MODEL_SWAPPING, f"worker is swapping to {self.swapping!r}")
        if self.draining:
            raise WorkerError(reasons.DRAINING, "worker is draining")
        if model is not None and not self.names.serves(model):
            raise WorkerError(reasons.UNKNOWN_MODEL,
                              f"model {model!r} is not served here (this worker serves {self.names.name!r})")

    def _undo(self, session: Session, *, keep_kv: bool) -> None:
        seq_id = self.table.release(session, keep_kv=keep_kv)
        if seq_id is not None:
            self.engine.free([seq_id])

    def _prepare_thread(self, request: GenerateRequest, history: list[Message],
                        cached: list[int]) -> tuple[list[int], list[Constraint | None], str]:
        """Off the event loop: the prompt's tokens and the request's grammar, compiled once per choice
        (each choice advances its own grammar state). A continuation's earlier tokens follow the prompt,
        its grammar advanced over them (`ConstraintError` when it refuses one), and their text third."""
        constraints: list[Constraint | None] = [None] * request.n
        if request.grammar is not None or request.json_schema is not None:
            constraints = [self.model.constraint(grammar=request.grammar, json_schema=request.json_schema,
                                                 lazy=request.grammar_lazy) for _ in range(request.n)]
        elif request.tools is not None and (call := self.model.tool_format.constraint(request.tools)) is not None:
            constraints = [self.model.constraint(grammar=call.grammar, json_schema=call.json_schema, lazy=call.lazy)
                           for _ in range(request.n)]
        tokens = self._prompt_tokens(request, history, cached)
        if not request.generated:
            return tokens, constraints, ""
        self._in_vocabulary(request.generated, "generated")
        if constraints[0] is not None:  # one choice: a continuation has no others
            replay(constraints[0], request.generated)
        text = b"".join(self.model.piece(t) for t in request.generated).decode("utf-8", errors="replace")
        return [*tokens, *request.generated], constraints, text

    def _prompt_tokens(self, request: GenerateRequest, history: list[Message], cached: list[int]) -> list[int]:
        if request.prompt_tokens is not None:
            self._in_vocabulary(request.prompt_tokens, "prompt")
            return [*cached, *request.prompt_tokens]  # as given; a raw session continues where its KV ends
        if request.raw and request.prompt is not None:
            if cached:  # a raw session continues exactly where its KV ends
                return cached + self.model.tokenize(request.prompt, add_special=False)
            return self.model.tokenize(request.prompt, add_special=True)
        return self.model.tokenize(self.model.render_chat(history, request.tools), add_special=True)


def _history(request: GenerateRequest, known: Session | None) -> list[Message]:
    """The conversation to render: the request's messages as they are (OpenAI-style clients resend
    the whole conversation; the cached prefix is found by comparing tokens), or the session's
    history plus the prompt as this turn's user message."""
    if request.messages is not None:
        return [Message(m.role, m.content, m.tool_calls, m.name) for m in request.messages]
    prompt = request.prompt or ""
    return [*known.messages, Message("user", prompt)] if known else [Message("user", prompt)]
