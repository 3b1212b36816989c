"""OpenAI-compatible HTTP server (FastAPI): /v1/completions, /v1/chat/completions, /v1/models,
/health, /metrics. The engine runs in its own thread; results reach asyncio through
``loop.call_soon_threadsafe``. Errors use OpenAI's envelope {"error": {message, type, param, code}}.

Chat template (documented, simple): each message becomes "<|{role}|>\\n{content}\\n", followed
by "<|assistant|>\\n"; generation stops at the tokenizer's EOS or at "<|".
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import math
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any, Literal

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from prometheus_client import generate_latest
from pydantic import BaseModel, ConfigDict, Field

from laplace_jax.errors import InvalidParamError, QueueFullError
from laplace_jax.serve.detok import TextStream
from laplace_jax.serve.engine import Engine, SamplingParams
from laplace_jax.serve.engine import Request as EngineRequest
from laplace_jax.serve.metrics import ServeMetrics

MAX_BODY_BYTES = 1 << 20  # default request body cap (413 above it)
MAX_STOP_STRINGS, MAX_STOP_CHARS = 8, 256
DISCONNECT_POLL_S = 0.05  # how often a waiting request checks that its client is still there


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class _Common(BaseModel):
    """Types only; value ranges are checked in one place, ``SamplingParams.check`` / ``Engine.check``."""

    model_config = ConfigDict(extra="forbid")
    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    ignore_eos: bool = False
    repetition_penalty: float = 1.0
    user: str | None = None


class CompletionRequest(_Common):
    prompt: str | list[int] | list[str]
    logprobs: int | None = None
    echo: bool = False


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "user", "assistant"]
    content: str


class ChatRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, type_: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.type = status, message, param, type_


def _envelope(status: int, message: str, param: str | None = None, type_: str = "invalid_request_error") -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": status}}


def _error(status: int, message: str, param: str | None = None, type_: str = "invalid_request_error", headers=None):
    return JSONResponse(_envelope(status, message, param, type_), status_code=status, headers=headers)


def chat_prompt(messages: list[ChatMessage]) -> str:
    return "".join(f"<|{m.role}|>\n{m.content}\n" for m in messages) + "<|assistant|>\n"


def _stop_strings(stop: str | list[str] | None) -> list[str]:
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if len(stops) > MAX_STOP_STRINGS:
        raise ApiError(400, f"at most {MAX_STOP_STRINGS} stop strings", "stop")
    if any(not 1 <= len(x) <= MAX_STOP_CHARS for x in stops):
        raise ApiError(400, f"each stop string must have 1 to {MAX_STOP_CHARS} characters", "stop")
    return stops


class Boundary:
    """ASGI middleware at the edge: API-key check on protected paths (401), then the body-size cap
    (413, from Content-Length or while reading a chunked body). The body is buffered (it is small
    by construction) and replayed to the app; later ``receive`` calls go to the client, so
    disconnects are still seen."""

    def __init__(self, app, api_key: str | None, protect_metrics: bool, max_body_bytes: int):
        self.app, self.max_body = app, max_body_bytes
        self.key = api_key.encode() if api_key else None
        self.protected = ("/v1/", "/metrics") if protect_metrics else ("/v1/",)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        if self.key is not None and scope["path"].startswith(self.protected):
            given = headers.get(b"authorization", b"")
            if not hmac.compare_digest(given, b"Bearer " + self.key):
                return await self._reply(
                    send, 401, "invalid or missing API key (send Authorization: Bearer KEY)", "authentication_error"
                )
        length = headers.get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_body):
            return await self._reply(
                send, 413, f"the request body exceeds {self.max_body} bytes", "invalid_request_error"
            )
        body = bytearray()
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            body += message.get("body", b"")
            if len(body) > self.max_body:
                return await self._reply(
                    send, 413, f"the request body exceeds {self.max_body} bytes", "invalid_request_error"
                )
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

    @staticmethod
    async def _reply(send, status: int, message: str, type_: str) -> None:
        payload = json.dumps(_envelope(status, message, None, type_)).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
        if status == 401:
            headers.append((b"www-authenticate", b"Bearer"))
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": payload})


class Server:
    """Holds the engine, tokenizer and metrics; ``app`` is the ASGI application.

    ``api_key``: required as ``Authorization: Bearer KEY`` on /v1/* (and /metrics with
    ``protect_metrics``); /health stays open. ``drain_timeout``: the whole shutdown sequence, from
    the signal to the last byte, takes at most this long (``begin_shutdown``).
    """

    def __init__(
        self,
        engine: Engine,
        tokenizer: Any,
        model_name: str,
        defaults: SamplingParams | None = None,
        *,
        api_key: str | None = None,
        protect_metrics: bool = False,
        max_body_bytes: int = MAX_BODY_BYTES,
        drain_timeout: float = 30.0,
    ):
        self.engine, self.tok, self.model_name = engine, tokenizer, model_name
        self.defaults = defaults or SamplingParams()
        self.metrics: ServeMetrics = engine.metrics
        self.drain_timeout = drain_timeout
        self.warm_progress = "starting"
        self.created = int(time.time())
        progress = lambda msg: setattr(self, "warm_progress", msg)  # noqa: E731
        self.thread = threading.Thread(target=engine.serve_forever, args=(progress,), name="engine", daemon=True)
        self.app = Boundary(self._build(), api_key, protect_metrics, max_body_bytes)

    def begin_shutdown(self) -> None:
        """Stop admitting; requests still running near the end of ``drain_timeout`` finish with "length"."""
        margin = min(1.0, 0.2 * self.drain_timeout)  # time left for the last chunks to reach the clients
        self.engine.begin_drain(self.drain_timeout - margin)

    # ----- request plumbing -------------------------------------------------------------
    def _sampling(self, body: _Common, max_tokens: int | None) -> SamplingParams:
        if body.n != 1:
            raise ApiError(400, "n > 1 is not supported; send separate requests", "n")
        if body.repetition_penalty != 1.0:
            raise ApiError(400, "repetition_penalty is not supported (only 1.0)", "repetition_penalty")
        d = self.defaults
        top_k = d.top_k if body.top_k is None else body.top_k
        return SamplingParams(
            max_tokens=d.max_tokens if max_tokens is None else max_tokens,
            temperature=d.temperature if body.temperature is None else body.temperature,
            top_p=d.top_p if body.top_p is None else body.top_p,
            top_k=0 if top_k == -1 else top_k,  # vLLM's -1 means off, like 0
            seed=body.seed,
            stop_token_ids=tuple(body.stop_token_ids or ()),
            ignore_eos=body.ignore_eos,
        )

    def _check_model(self, name: str) -> None:
        if name != self.model_name:
            raise ApiError(
                404,
                f"model {name!r} does not exist; this server serves {self.model_name!r}",
                "model",
                "not_found_error",
            )

    def _prompt_ids(self, prompt: str | list[int] | list[str]) -> list[int]:
        if isinstance(prompt, str):
            return self.tok.encode(prompt)
        if prompt and all(isinstance(p, str) for p in prompt):
            if len(prompt) != 1:
                raise ApiError(400, "batched prompts are not supported; send one prompt per request", "prompt")
            return self.tok.encode(prompt[0])
        return [int(t) for t in prompt]  # the engine checks the range

    @staticmethod
    async def _watch_disconnect(request: Request, req: EngineRequest, queue: asyncio.Queue) -> None:
        while not req.cancelled:
            if await request.is_disconnected():
                req.cancelled = True  # the engine frees the slot before its next decode call
                queue.put_nowait(([], "gone"))
                return
            await asyncio.sleep(DISCONNECT_POLL_S)

    async def _generate(self, request: Request, ids: list[int], sp: SamplingParams, stops: list[str]):
        """Async iterator of (text delta, finish_reason | None, completion tokens).

        Raises ``ApiError`` (400/429 before the first item; 500 if the engine ends the request
        with an error). Returns without a finish when the client went away."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()

        def emit(tokens: list[int], reason: str | None) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, (tokens, reason))

        req = EngineRequest(ids, sp, emit, id=uuid.uuid4().hex)
        try:
            self.engine.submit(req)
        except QueueFullError as e:
            raise ApiError(429, f"server busy: {e}", None, "rate_limit_error") from e
        except InvalidParamError as e:
            raise ApiError(400, str(e), e.param) from e
        text = TextStream(self.tok, stops, ids)
        watcher = asyncio.create_task(self._watch_disconnect(request, req, queue))
        n = 0
        try:
            while True:
                tokens, reason = await queue.get()
                if reason == "gone":
                    return
                if reason == "error":
                    raise ApiError(500, req.error or "the request failed", None, "server_error")
                n += len(tokens)
                delta, hit = text.push(tokens)
                if reason is not None and not hit:
                    rest, hit = text.finish()
                    delta += rest
                if hit:
                    req.cancelled = True  # a stop string: the engine frees the slot next call
                    reason = "stop"
                if reason is not None:
                    finish = {"shutdown": "length", "abort": "stop"}.get(reason, reason)
                    self.metrics.on_finish(req, finish, n)
                    yield delta, finish, n
                    return
                if delta:
                    yield delta, None, n
        finally:
            req.cancelled = True  # client gone or request over: the engine frees the slot next call
            watcher.cancel()

    async def _respond(
        self, request: Request, body: _Common, ids: list[int], sp: SamplingParams, chat: bool, echo: bool = False
    ):
        stops = _stop_strings(body.stop) + (["<|"] if chat else [])
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())
        gen = self._generate(request, ids, sp, stops)
        try:
            first = await anext(gen)  # raises ApiError (400/429/500) before any response is sent
        except StopAsyncIteration:  # the client left before the first token
            return JSONResponse({}, status_code=499)
        prefix = self.tok.decode(ids) if echo else ""  # the engine has accepted ids: all within the vocab

        def usage(n: int) -> dict:
            return {"prompt_tokens": len(ids), "completion_tokens": n, "total_tokens": len(ids) + n}

        obj = ("chat.completion" if chat else "text_completion") + (".chunk" if chat and body.stream else "")
        head = {"id": rid, "object": obj, "created": created, "model": self.model_name}
        if not body.stream:
            text, reason, n = first
            async for delta, r, n in gen:  # noqa: B007 - n is the final count
                text, reason = text + delta, r
            if reason is None:  # the client left: nobody reads this
                return JSONResponse({}, status_code=499)
            text = prefix + text
            if chat:
                choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": reason}
            else:
                choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}
            return JSONResponse({**head, "choices": [choice], "usage": usage(n)})

        include_usage = bool(body.stream_options and body.stream_options.include_usage)

        def chunk(delta: str, reason: str | None, role: bool = False) -> str:
            if chat:
                d = {"role": "assistant", "content": delta} if role else {"content": delta}
                choice = {"index": 0, "delta": d, "finish_reason": reason}
            else:
                choice = {"index": 0, "text": delta, "logprobs": None, "finish_reason": reason}
            return f"data: {json.dumps({**head, 'choices': [choice]})}\n\n"

        async def events():
            delta, reason, n = first
            yield chunk(prefix + delta, reason, role=True)
            try:
                async for delta, reason, n in gen:  # noqa: B007 - n is the final count
                    yield chunk(delta, reason)
            except ApiError as e:  # the response has started: report the failure in the stream
                self.metrics.errors.labels(e.type).inc()
                yield f"data: {json.dumps(_envelope(e.status, e.message, e.param, e.type))}\n\n"
            else:
                if include_usage:
                    yield f"data: {json.dumps({**head, 'choices': [], 'usage': usage(n)})}\n\n"
            yield "data: [DONE]\n\n"

        async def guarded():
            try:
                async for e in events():
                    yield e
            finally:
                await gen.aclose()

        return StreamingResponse(guarded(), media_type="text/event-stream")

    # ----- app ----------------------------------------------------------------------------
    def _build(self) -> FastAPI:
        @contextlib.asynccontextmanager
        async def lifespan(app):
            self.thread.start()
            yield
            self.begin_shutdown()  # no-op if a signal already started it (the earlier deadline wins)
            await asyncio.to_thread(self.engine.stop, True, self.drain_timeout)

        app = FastAPI(title="laplace-jax", lifespan=lifespan)
        self._add_error_handlers(app)
        self._add_status_routes(app)
        self._add_generation_routes(app)
        return app

    def _reply(self, exc: ApiError):
        self.metrics.errors.labels(exc.type).inc()
        headers = {"Retry-After": "1"} if exc.status == 429 else None
        return _error(exc.status, exc.message, exc.param, exc.type, headers)

    def _not_ready(self) -> str | None:
        """Why the engine cannot serve now (warming, restarting, dead), or None."""
        state, message = self.engine.status()
        if state == "ready":
            return None
        return f"warming up: {self.warm_progress}" if state == "warming" else message

    def _ready_or_503(self) -> None:
        if (why := self._not_ready()) is not None:
            raise ApiError(503, why, None, "server_error")

    def _add_error_handlers(self, app: FastAPI) -> None:
        @app.exception_handler(RequestValidationError)
        async def _invalid(_, exc: RequestValidationError):
            err = exc.errors()[0] if exc.errors() else {}
            loc = [str(x) for x in err.get("loc", []) if x != "body"]
            param = ".".join(loc) or None
            if err.get("type") == "extra_forbidden":
                return self._reply(ApiError(400, f"unknown parameter {param!r}", param))
            if err.get("type") == "json_invalid":
                return self._reply(ApiError(400, "the request body is not valid JSON", None))
            return self._reply(ApiError(400, f"{param or 'body'}: {err.get('msg', 'invalid value')}", param))

        @app.exception_handler(ApiError)
        async def _api(_, exc: ApiError):
            return self._reply(exc)

    def _add_status_routes(self, app: FastAPI) -> None:
        @app.get("/health")
        async def health():
            if (why := self._not_ready()) is not None:
                return _error(503, why, None, "server_error")
            return {"status": "ok", "restarts": self.engine.restarts}

        @app.get("/v1/models")
        async def models():
            card = {
                "id": self.model_name,
                "object": "model",
                "created": self.created,
                "owned_by": "laplace-jax",
                "root": self.model_name,
                "max_model_len": self.engine.max_model_len,
            }
            return {"object": "list", "data": [card]}

        @app.get("/metrics")
        async def metrics():
            running, waiting = self.engine.counts()
            self.metrics.running.set(running)
            self.metrics.waiting.set(waiting)
            for d, n in enumerate(self.engine.occupancy()):
                self.metrics.device_slots_used.labels(str(d)).set(n)
            return PlainTextResponse(
                generate_latest(self.metrics.registry).decode(), media_type="text/plain; version=0.0.4"
            )

    def _add_generation_routes(self, app: FastAPI) -> None:
        @app.post("/v1/completions")
        async def completions(request: Request, body: CompletionRequest):
            self._ready_or_503()
            self._check_model(body.model)
            if body.logprobs is not None:
                raise ApiError(400, "logprobs are not supported", "logprobs")
            ids = self._prompt_ids(body.prompt)
            return await self._respond(request, body, ids, self._sampling(body, body.max_tokens), False, body.echo)

        @app.post("/v1/chat/completions")
        async def chat(request: Request, body: ChatRequest):
            self._ready_or_503()
            self._check_model(body.model)
            sp = self._sampling(body, body.max_completion_tokens or body.max_tokens)
            ids = self.tok.encode(chat_prompt(body.messages))
            return await self._respond(request, body, ids, sp, True)


class _Uvicorn(uvicorn.Server):
    """uvicorn that starts the engine's drain the moment SIGTERM/SIGINT arrives, so the drain and
    uvicorn's graceful wait run at once, both bounded by the server's ``drain_timeout``."""

    def __init__(self, config: uvicorn.Config, on_exit: Callable[[], None]):
        super().__init__(config)
        self._on_exit = on_exit

    def handle_exit(self, sig, frame) -> None:
        self._on_exit()
        super().handle_exit(sig, frame)


def make_uvicorn(server: Server, host: str, port: int, log_level: str = "warning") -> uvicorn.Server:
    config = uvicorn.Config(
        server.app,
        host=host,
        port=port,
        log_level=log_level,
        timeout_graceful_shutdown=math.ceil(server.drain_timeout),
    )
    return _Uvicorn(config, server.begin_shutdown)


class BackgroundServer:
    """Run a ``Server`` with uvicorn in a thread on a loopback port (tests, benchmarks, notebooks)."""

    def __init__(self, server: Server, port: int, host: str = "127.0.0.1", ready_timeout: float = 600.0):
        self.server, self.url = server, f"http://{host}:{port}"
        self.uv = make_uvicorn(server, host, port, log_level="error")
        self.thread = threading.Thread(target=self.uv.run, daemon=True)
        t0 = time.perf_counter()
        self.thread.start()
        while time.perf_counter() - t0 < ready_timeout:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.url + "/health").status_code == 200:
                    self.ready_seconds = time.perf_counter() - t0
                    return
            state, message = server.engine.status()
            if state == "dead":
                raise RuntimeError(message)
            time.sleep(0.1)
        raise TimeoutError(f"server not ready after {ready_timeout} s ({server.warm_progress})")

    def close(self) -> None:
        self.server.begin_shutdown()
        self.uv.should_exit = True
        self.thread.join(60)
