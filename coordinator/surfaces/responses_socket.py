"""The Responses API over a WebSocket: `/v1/responses` upgraded, as Codex CLI and the `openai` package's
`client.responses.connect()` speak it.

Owns: the socket's life (the bound on open sockets, the handshake's refusal, the idle close), its
messages (`response.create` with the POST body's fields; one response at a time; a message that is
not JSON, too large or of another type answered with an `error` event, the socket kept open), the
chains it keeps for its life (`responses_chains.Chains`: a `previous_response_id` naming a response
made earlier on this socket continues it, its conversation put before the new input, so the turn's
prompt starts with the one the worker just ran and its prefix cache reuses it; an unknown one gets
OpenAI's `previous_response_not_found`; a failed continuation forgets the chain it continued), and
`generate: false` (the request recorded as a response to continue, nothing generated).
Must not: parse the POST body (responses.py does, the same for both), shape events (responses_format's
`EventEncoder`: each SSE event's JSON is one text message, relay/socket.py) or admit, schedule and
relay (the gateway does, as for every request).

API keys: the app's gate checks the handshake as any request (coordinator/app.py) and refuses it with
OpenAI's 401 body; its tenant is the socket's for every turn.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import uuid
from typing import Any

from fastapi import APIRouter
from pydantic import ValidationError
from starlette.responses import Response
from starlette.types import Message, Receive, Scope, Send
from starlette.websockets import WebSocket

from coordinator.auth import tenant_of
from coordinator.errors import CoordinatorError
from coordinator.gateway import Gateway
from coordinator.relay.socket import SocketStream
from coordinator.settings import Settings
from coordinator.state import CoordinatorState
from coordinator.surfaces import responses
from coordinator.surfaces import responses_stored as stored
from coordinator.surfaces.openai import Asker, error_response, open_parsed
from coordinator.surfaces.responses_chains import Chains, Items
from coordinator.surfaces.responses_format import EventEncoder, Shape
from coordinator.validate import describe, first_field
from protocol import openai_responses as rs
from protocol import reasons

SURFACE = "openai-responses-socket"
IN_FLIGHT = "response_in_flight"  # a response.create while this socket's response still runs
IDLE_CLOSE = 1001  # going away: the socket was quiet for RESPONSES_SOCKET_IDLE
FINISHED = frozenset({"completed", "incomplete"})  # a response one may continue

router = APIRouter()


class Sockets:
    """The Responses WebSockets open on this coordinator, at most `limit` (app.state.responses_sockets)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.open = 0

    def enter(self) -> bool:
        if self.open >= self.limit:
            return False
        self.open += 1
        return True

    def leave(self) -> None:
        self.open -= 1


async def refuse_handshake(scope: Scope, receive: Receive, send: Send, refusal: Response) -> None:
    """`refusal` as the handshake's HTTP answer where the server can send one (uvicorn can), else a
    close before accepting (1008, which a server answers 403)."""
    if "websocket.http.response" in scope.get("extensions", {}):
        await refusal(scope, receive, send)
    else:
        await send({"type": "websocket.close", "code": 1008, "reason": ""})


async def serve(websocket: WebSocket) -> None:
    state: CoordinatorState = websocket.app.state.coordinator
    sockets: Sockets = websocket.app.state.responses_sockets
    if not sockets.enter():
        exc = CoordinatorError(reasons.STREAMS_FULL, f"this coordinator holds {sockets.limit} Responses WebSockets "
                               "(RESPONSES_SOCKETS); use HTTP, or try again", status=503, retry_after=1)
        await refuse_handshake(websocket.scope, websocket.receive, websocket.send, error_response("", exc))
        return
    try:
        await websocket.accept()
        await Socket(websocket, state, websocket.app.state.gateway).run()
    finally:
        sockets.leave()


class Socket:
    """One accepted socket: its messages in order, at most one response running."""

    def __init__(self, websocket: WebSocket, state: CoordinatorState, gateway: Gateway) -> None:
        settings: Settings = state.settings
        self._ws = websocket
        self._state = state
        self._gateway = gateway
        self._settings = settings
        self._chains = Chains(max_items=settings.responses_socket_chain_items,
                              max_bytes=settings.responses_socket_chain_bytes)
        self._sending = asyncio.Lock()  # a refusal may go out while a response streams
        self._gone = asyncio.Event()
        self._turn: asyncio.Task[None] | None = None
        self._answered = False  # the running response's final event is on its way: it only winds up now
        self._receiving: asyncio.Task[Message] | None = None
        self._quiet_since = 0.0
        self._tenant = tenant_of(websocket.scope.get("state", {}))

    async def run(self) -> None:
        self._quiet_since = asyncio.get_running_loop().time()
        try:
            while (message := await self._next()) is not None:
                await self._take(message)
        finally:
            self._gone.set()  # a running response ends as the client's leaving (its supervisor's rules)
            if self._receiving is not None:
                self._receiving.cancel()
            if self._turn is not None:
                await asyncio.gather(self._turn, return_exceptions=True)

    async def _next(self) -> Message | None:
        """The client's next message; None once it has gone, or the socket was closed for idling. A
        running response is not idling, and the idle time counts from its end."""
        loop = asyncio.get_running_loop()
        while True:
            if self._receiving is None:
                self._receiving = asyncio.create_task(self._ws.receive())
            running = self._turn is not None and not self._turn.done()
            timeout = None if running else self._quiet_since + self._settings.responses_socket_idle - loop.time()
            if timeout is not None and timeout <= 0:
                await self._ws.close(IDLE_CLOSE, "idle")
                return None
            waits: set[asyncio.Task[Any]] = {self._receiving, *([self._turn] if running and self._turn else [])}
            done, _ = await asyncio.wait(waits, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
            if self._receiving in done:
                message, self._receiving = self._receiving.result(), None
                self._quiet_since = loop.time()
                return None if message["type"] == "websocket.disconnect" else message
            if running and self._turn is not None and self._turn.done():
                self._quiet_since = loop.time()

    async def _take(self, message: Message) -> None:
        """Start the response a message asks for, or answer why not (an `error` event). A message sent
        on the previous response's final event waits for that response to wind up (its ending, already
        under way), as a client that reads the final event may send its next turn at once."""
        if self._turn is not None and not self._turn.done() and self._answered:
            await asyncio.gather(self._turn, return_exceptions=True)
        try:
            create = self._read(message)
            chain, prefer = await self._chain_of(create)
            if self._turn is not None and not self._turn.done():
                raise CoordinatorError(IN_FLIGHT, "a response is still running on this socket: send the next "
                                       "response.create after its final event", status=409)
        except CoordinatorError as exc:
            self._refused(exc)
            return
        self._answered = False
        self._turn = asyncio.create_task(self._respond(create, chain, prefer))

    def _read(self, message: Message) -> rs.SocketCreate:
        limit = self._settings.responses_socket_message_bytes
        text = message.get("text")
        data = text.encode() if isinstance(text, str) else message.get("bytes") or b""
        if len(data) > limit:
            raise CoordinatorError(reasons.BODY_TOO_LARGE, f"message of {len(data)} bytes, over this pool's "
                                   f"{limit} (RESPONSES_SOCKET_MESSAGE_BYTES); it was dropped", status=413)
        try:
            found = json.loads(data)
        except ValueError as exc:
            raise CoordinatorError(reasons.INVALID_REQUEST, f"message: not JSON ({exc})") from None
        if not isinstance(found, dict):
            raise CoordinatorError(reasons.INVALID_REQUEST, "message: give a JSON object, "
                                   f'{{"type": "{rs.CREATE_EVENT}", ...}}')
        try:
            return rs.SocketCreate.model_validate(found)
        except ValidationError as exc:
            raise CoordinatorError(reasons.INVALID_REQUEST, describe(exc), param=first_field(exc)) from None

    async def _chain_of(self, create: rs.SocketCreate) -> tuple[Items, str | None]:
        """The conversation `previous_response_id` continues: this socket's own, else a stored one (and
        the worker holding it, preferred)."""
        if create.previous_response_id is None:
            return (), None
        chain = self._chains.get(create.previous_response_id)
        if chain is not None:
            return chain, None
        worker_id, record = await stored.stored(self._state, self._tenant, create.previous_response_id)
        return tuple(record.get("items", ())), worker_id

    async def _respond(self, create: rs.SocketCreate, chain: Items, prefer: str | None) -> None:
        request_id = uuid.uuid4().hex
        started = self._gateway.now()
        body = dict(create.model_extra or {})
        given = body.get("input")
        new = [{"role": "user", "content": given}] if isinstance(given, str) else given
        items = (*chain, *new) if isinstance(new, list) else None
        body.update(input=list(items) if items is not None else given, stream=True)
        previous = create.previous_response_id
        keeps = self._settings.responses_store and body.get("store") is not False
        try:
            if not create.generate:
                await self._record(json.dumps(body).encode(), request_id, previous, items or ())
                return
            opened, gen, echo = await open_parsed(
                self._gateway, json.dumps(body).encode(), responses.parse,
                Asker(request_id, SURFACE, self._ws.headers, self._ws.scope.get("state", {})), started,
                client_gone=self._gone_wait, prefer=prefer)
        except CoordinatorError as exc:
            if previous is not None:
                self._chains.forget(previous)
            self._send_error(exc, request_id)
            return
        echo = dataclasses.replace(echo, temperature=gen.request.temperature, top_p=gen.request.top_p,
                                   previous_response_id=previous, store=keeps)
        encoder = EventEncoder(Shape(echo, request_id, int(self._state.clock.time()), opened.model),
                               now=self._state.clock.time)

        async def send_text(text: str) -> None:
            if encoder.ended is not None and not self._answered:  # kept before the client can read its end
                self._answered = True
                self._kept(encoder.ended, previous, items or ())
                if keeps:
                    turn = stored.Turn({}, previous, list(chain), list(new or ()), store=True)
                    stored.finished(turn, encoder.ended, self._settings.responses_record_bytes)
                    await stored.keep(self._state, turn, opened.last_worker, self._tenant, encoder.ended.id)
            await self._send_text(text)

        stream = SocketStream(opened.relay, on_end=opened.finish, encoder=encoder, send_text=send_text,
                              now=self._state.clock.monotonic)
        await stream(self._ws.scope, self._gone_receive, _nowhere)
        if not self._answered:
            self._kept(encoder.ended, previous, items or ())

    async def _record(self, raw: bytes, request_id: str, previous: str | None, items: Items) -> None:
        """`generate: false`: the request, checked as any, becomes a response with no output to continue."""
        _, echo = responses.parse(raw)
        model = json.loads(raw).get("model") or ""
        shape = Shape(dataclasses.replace(echo, previous_response_id=previous), request_id,
                      int(self._state.clock.time()), model if isinstance(model, str) else "")
        opening = rs.ResponseEvent(type=rs.CREATED, sequence_number=0, response=shape.response("in_progress", []))
        ended = shape.response("completed", [], completed_at=int(self._state.clock.time()))
        await self._send_text(opening.model_dump_json())
        self._answered = True
        self._kept(ended, previous, items)
        await self._send_text(rs.ResponseEvent(type=rs.COMPLETED, sequence_number=1, response=ended).model_dump_json())

    def _kept(self, ended: rs.ResponseObject | None, previous: str | None, items: Items) -> None:
        """A finished response's conversation kept to continue; a failed continuation forgets its chain."""
        if ended is None or ended.status not in FINISHED:
            if previous is not None:
                self._chains.forget(previous)
            return
        output = tuple(item.model_dump(mode="json", exclude_none=True) for item in ended.output)
        self._chains.keep(ended.id, (*items, *output))

    def _refused(self, exc: CoordinatorError) -> None:
        request_id = uuid.uuid4().hex
        self._gateway.refused(request_id, exc, self._gateway.now(), surface=SURFACE)
        self._send_error(exc, request_id)

    def _send_error(self, exc: CoordinatorError, request_id: str) -> None:
        """OpenAI's error event: the status and the error object of the HTTP route's refusal."""
        refusal = error_response(request_id, exc)
        error = json.loads(bytes(refusal.body))["error"]
        event = rs.SocketError(status=refusal.status_code, error=rs.SocketErrorBody.model_validate(error))
        sending = asyncio.ensure_future(self._send_text(event.model_dump_json()))
        sending.add_done_callback(_settled)

    async def _send_text(self, text: str) -> None:
        async with self._sending:
            await self._ws.send_text(text)

    async def _gone_wait(self) -> None:
        await self._gone.wait()

    async def _gone_receive(self) -> Message:
        await self._gone.wait()
        return {"type": "http.disconnect"}


def _settled(task: asyncio.Future[None]) -> None:
    """An error event that could not be sent: the client has gone, which the socket's loop sees too."""
    if not task.cancelled():
        task.exception()


async def _nowhere(message: Message) -> None:
    raise RuntimeError("a socket's stream sends through the socket, not the ASGI send")


router.add_api_websocket_route(responses.PATH, serve, name="responses_socket")
