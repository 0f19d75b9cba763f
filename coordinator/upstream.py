"""The coordinator's HTTP client to workers: a streaming POST over pooled keep-alive connections.

Owns: the connection pool to workers, its timeouts, turning the HTTP library's errors into two of
ours: `WorkerUnreachable` (no response at all; `WorkerRefused` when nothing listens at the address)
and `WorkerStreamError` (the body broke), and the worker token (`with_token`): built into the client
once from the settings, so that every call to a worker carries it and no caller writes the header.
Must not: know what a request or an event means (relay/ does).

Why aiohttp here when the rest of the project speaks httpx: this client carries every token of every
stream, so its cost per read is the coordinator's cost per token. `python -m bench.upstream_bench`
(retired in 7737c5b: `git show 7737c5b:bench/upstream_bench.py`; a loopback server streaming
20,000 SSE chunks, uvloop, server included) measured 12.0 us of CPU per chunk for aiohttp against
32.4 us for httpx on this project's 2-core machine. And httpcore's pool walks every pooled connection on each request and each release, which showed up in profiles of
`bench.scale_bench` at hundreds of open streams; aiohttp keeps a pool per worker.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping
from typing import Protocol

import aiohttp

_MAX_GET_BYTES = 65_536  # a worker's health is well under 1 KiB: read no more from a stranger


class WorkerUnreachable(Exception):
    """No response came back: the connection failed, was refused, or closed before a status line."""


class WorkerRefused(WorkerUnreachable):
    """The connection was refused: nothing listens at the worker's address, so its process is gone (or not
    started yet). Unlike a timeout this is certain at once, and the registry stops scheduling on it
    (`Registry.lost`) before its heartbeats have had time to stop."""


class WorkerStreamError(Exception):
    """The worker's response broke after its status line (connection lost, read timeout, garbage)."""


class WorkerResponse(Protocol):
    @property
    def status(self) -> int: ...

    def header(self, name: str) -> str | None: ...

    def chunks(self) -> AsyncIterator[bytes]:
        """The body as it arrives; raises `WorkerStreamError` if it breaks."""
        ...

    async def read(self) -> bytes: ...

    async def close(self) -> None:
        """Hands the connection back to the pool when the body was read to its end; closes it otherwise
        (which is how a worker learns that the request is cancelled)."""
        ...


class WorkerClient(Protocol):
    async def post(self, url: str, body: bytes, headers: Mapping[str, str], *,
                   read_timeout: float | None = None) -> WorkerResponse:
        """`read_timeout`: the longest silence allowed on this call, in place of the pool's (a worker
        computing an embedding answers nothing until it is done)."""
        ...

    async def delete(self, url: str, headers: Mapping[str, str]) -> int:
        """The status of a DELETE, its body read and dropped; `WorkerUnreachable` when there is none."""
        ...

    async def get(self, url: str) -> tuple[int, bytes]:
        """The status and body of a GET (a worker's health: small); `WorkerUnreachable` when there is none."""
        ...

    async def exchange(self, method: str, url: str, headers: Mapping[str, str], body: bytes | None = None, *,
                       limit: int, timeout: float) -> tuple[int, bytes]:
        """One whole request and answer within `timeout` seconds (a session's KV, moved: megabytes), the
        answer's body at most `limit` bytes; `WorkerUnreachable` when it cannot be had whole."""
        ...

    async def close(self) -> None: ...


class _AiohttpResponse:
    __slots__ = ("_response",)

    def __init__(self, response: aiohttp.ClientResponse) -> None:
        self._response = response

    @property
    def status(self) -> int:
        return self._response.status

    def header(self, name: str) -> str | None:
        return self._response.headers.get(name)

    async def chunks(self) -> AsyncIterator[bytes]:
        content = self._response.content
        try:
            while True:
                chunk = await content.readany()
                if not chunk:
                    return
                yield chunk
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise WorkerStreamError(f"{type(exc).__name__}: {exc}") from exc

    async def read(self) -> bytes:
        try:
            return await self._response.read()
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise WorkerStreamError(f"{type(exc).__name__}: {exc}") from exc

    async def close(self) -> None:
        if self._response.content.at_eof():
            self._response.release()
        else:
            self._response.close()


class AiohttpWorkerClient:
    """One pool for all workers (aiohttp keys it by host and port); created inside the running loop."""

    def __init__(self, *, max_connections: int, connect_timeout: float, read_timeout: float,
                 keepalive_expiry: float) -> None:
        connector = aiohttp.TCPConnector(limit=max_connections, limit_per_host=0,
                                         keepalive_timeout=keepalive_expiry, enable_cleanup_closed=False)
        self._connect_timeout = connect_timeout
        timeout = aiohttp.ClientTimeout(total=None, connect=connect_timeout, sock_read=read_timeout)
        # No cookies, no proxies from the environment, no automatic decompression: workers are ours.
        self._session = aiohttp.ClientSession(connector=connector, timeout=timeout, trust_env=False,
                                              cookie_jar=aiohttp.DummyCookieJar(), auto_decompress=False,
                                              skip_auto_headers=("User-Agent",))

    async def post(self, url: str, body: bytes, headers: Mapping[str, str], *,
                   read_timeout: float | None = None) -> WorkerResponse:
        try:
            if read_timeout is None:  # the pool's own timeouts (the hot path: every generation)
                response = await self._session.post(url, data=body, headers=dict(headers), allow_redirects=False)
            else:
                timeout = aiohttp.ClientTimeout(total=None, connect=self._connect_timeout, sock_read=read_timeout)
                response = await self._session.post(url, data=body, headers=dict(headers), allow_redirects=False,
                                                    timeout=timeout)
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise _unreachable(exc) from exc
        return _AiohttpResponse(response)

    async def delete(self, url: str, headers: Mapping[str, str]) -> int:
        try:
            async with self._session.delete(url, headers=dict(headers), allow_redirects=False) as response:
                await response.read()
                return response.status
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise _unreachable(exc) from exc

    async def get(self, url: str) -> tuple[int, bytes]:
        try:
            async with self._session.get(url, allow_redirects=False) as response:
                body = b""
                while len(body) < _MAX_GET_BYTES and (chunk := await response.content.readany()):
                    body += chunk
                return response.status, body[:_MAX_GET_BYTES]
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise _unreachable(exc) from exc

    async def exchange(self, method: str, url: str, headers: Mapping[str, str], body: bytes | None = None, *,
                       limit: int, timeout: float) -> tuple[int, bytes]:
        try:
            async with asyncio.timeout(timeout), self._session.request(
                    method, url, data=body, headers=dict(headers), allow_redirects=False) as response:
                chunks, size = [], 0
                while chunk := await response.content.readany():
                    size += len(chunk)
                    if size > limit:
                        raise WorkerUnreachable(f"the answer is over {limit} bytes")
                    chunks.append(chunk)
                return response.status, b"".join(chunks)
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise _unreachable(exc) from exc

    async def close(self) -> None:
        await self._session.close()


class _WithToken:
    """A `WorkerClient` whose calls carry `authorization: Bearer <worker token>` (the workers' routes
    answer only its holder), except `get`: the probe of a URL a heartbeat advertised, not yet proven to
    be a worker's (pool/probe.py), which gets no secret, and a worker's health needs none."""

    __slots__ = ("_auth", "_client")

    def __init__(self, client: WorkerClient, token: str) -> None:
        self._client = client
        self._auth = {"authorization": f"Bearer {token}"}

    async def post(self, url: str, body: bytes, headers: Mapping[str, str], *,
                   read_timeout: float | None = None) -> WorkerResponse:
        return await self._client.post(url, body, {**headers, **self._auth}, read_timeout=read_timeout)

    async def delete(self, url: str, headers: Mapping[str, str]) -> int:
        return await self._client.delete(url, {**headers, **self._auth})

    async def get(self, url: str) -> tuple[int, bytes]:
        return await self._client.get(url)

    async def exchange(self, method: str, url: str, headers: Mapping[str, str], body: bytes | None = None, *,
                       limit: int, timeout: float) -> tuple[int, bytes]:
        return await self._client.exchange(method, url, {**headers, **self._auth}, body, limit=limit,
                                           timeout=timeout)

    async def close(self) -> None:
        await self._client.close()


def with_token(client: WorkerClient, token: str | None) -> WorkerClient:
    """`client`, its calls carrying the worker token when one is set (WORKER_TOKEN)."""
    return _WithToken(client, token) if token else client


def _unreachable(exc: Exception) -> WorkerUnreachable:
    refused = isinstance(exc, aiohttp.ClientConnectorError) and isinstance(exc.os_error, ConnectionRefusedError)
    return (WorkerRefused if refused else WorkerUnreachable)(f"{type(exc).__name__}: {exc}")
