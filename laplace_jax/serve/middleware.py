"""ASGI middleware at the server's edge: the API key, the body-size cap and the body-read timeout.

Every refusal here uses OpenAI's error envelope. The body is buffered (it is small by
construction) and replayed to the app; later ``receive`` calls go to the client, so the app
still sees a disconnect.
"""

from __future__ import annotations

import asyncio
import hmac
import json

from laplace_jax.serve.protocol import envelope

PROTECTED = (
    "/v1/",
    "/tokenize",
    "/detokenize",
    "/start_profile",
    "/stop_profile",
)  # /health, /version, /tokenizer_info stay open


class Boundary:
    """API-key check on protected paths (401), the body-size cap (413, from Content-Length or
    while reading a chunked body), compressed bodies (415) and a body that does not arrive
    within ``body_timeout`` seconds (408)."""

    def __init__(self, app, api_key: str | None, protect_metrics: bool, max_body_bytes: int, body_timeout: float):
        self.app, self.max_body, self.body_timeout = app, max_body_bytes, body_timeout
        self.key = api_key.encode() if api_key else None
        self.protected = (*PROTECTED, "/metrics") if protect_metrics else PROTECTED

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        if self.key is not None and scope["path"].startswith(self.protected):
            given = headers.get(b"authorization", b"")
            if not hmac.compare_digest(given, b"Bearer " + self.key):
                return await reply(
                    send, 401, "invalid or missing API key (send Authorization: Bearer KEY)", "authentication_error"
                )
        if headers.get(b"content-encoding", b"identity").lower() not in (b"identity", b""):
            return await reply(send, 415, "compressed request bodies are not supported; send plain JSON")
        length = headers.get(b"content-length")
        too_big = f"the request body exceeds {self.max_body} bytes"
        if length is not None and (not length.isdigit() or int(length) > self.max_body):
            return await reply(send, 413, too_big)
        body = bytearray()
        while True:
            try:
                message = await asyncio.wait_for(receive(), self.body_timeout)
            except TimeoutError:
                return await reply(send, 408, f"the request body did not arrive within {self.body_timeout:g} s")
            if message["type"] == "http.disconnect":
                return None
            body += message.get("body", b"")
            if len(body) > self.max_body:
                return await reply(send, 413, too_big)
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": bytes(body), "more_body": False}
            return await receive()

        return await self.app(scope, replay, send)


async def reply(send, status: int, message: str, type_: str = "invalid_request_error") -> None:
    """Send an error response in OpenAI's envelope from raw ASGI."""
    payload = json.dumps(envelope(status, message, None, type_)).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
    if status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    if status == 408:
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": payload})
