"""Cross-origin requests from browsers: the configured origins (`CORS_ORIGINS`; none by default) may call
the coordinator from a web page.

Owns: answering a preflight (`OPTIONS` with `Access-Control-Request-Method`) from an allowed origin,
and the `Access-Control-*` headers on the responses to that origin.
Must not: authenticate (the API keys still apply to the real request; a preflight carries no key) or
touch a request from anywhere else: with no `Origin` header, or another origin, it passes through
unchanged, so browsers of other origins get no permission and other clients pay one header lookup.

It wraps the whole app, the streaming fast paths included, so a page can stream tokens; for a stream
it adds its headers to the response head only.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

ALLOWED_METHODS = b"GET, POST, DELETE, OPTIONS"
ALLOWED_HEADERS = b"authorization, content-type, x-api-key, x-request-id, openai-organization, openai-project"
EXPOSED_HEADERS = (b"x-request-id, x-worker-id, retry-after, x-ratelimit-limit-requests, "
                   b"x-ratelimit-remaining-requests, x-ratelimit-reset-requests, x-ratelimit-limit-tokens, "
                   b"x-ratelimit-remaining-tokens, x-ratelimit-reset-tokens")
PREFLIGHT_MAX_AGE = b"600"


class Cors:
    def __init__(self, app: ASGIApp, origins: frozenset[str]) -> None:
        self.app = app
        self._origins = origins
        self._any = "*" in origins

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        origin = _header(scope, b"origin") if self._origins and scope["type"] == "http" else None
        if origin is None or not (self._any or origin.decode("latin-1") in self._origins):
            await self.app(scope, receive, send)
            return
        allow = [(b"access-control-allow-origin", origin), (b"vary", b"Origin")]
        if scope["method"] == "OPTIONS" and _header(scope, b"access-control-request-method") is not None:
            await send({"type": "http.response.start", "status": 200, "headers": [
                *allow, (b"access-control-allow-methods", ALLOWED_METHODS),
                (b"access-control-allow-headers", ALLOWED_HEADERS),
                (b"access-control-max-age", PREFLIGHT_MAX_AGE), (b"content-length", b"0")]})
            await send({"type": "http.response.body", "body": b""})
            return

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), *allow,
                                                  (b"access-control-expose-headers", EXPOSED_HEADERS)]}
            await send(message)

        await self.app(scope, receive, send_with_headers)


def _header(scope: Scope, name: bytes) -> bytes | None:
    for key, value in scope["headers"]:
        if key == name:
            return bytes(value)
    return None


def parse_origins(setting: str) -> frozenset[str]:
    """`CORS_ORIGINS`: comma-separated origins (`https://app.example.com`), or `*` for any."""
    return frozenset(o.strip().rstrip("/") for o in setting.split(",") if o.strip())
