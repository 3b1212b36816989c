"""OpenAI-compatible HTTP server (FastAPI): /v1/completions, /v1/chat/completions, /v1/models,
/health, /metrics. The engine runs in its own thread; results reach asyncio through
``loop.call_soon_threadsafe``. Errors use OpenAI's envelope {"error": {message, type, param, code}}.

Chat template (documented, simple): each message becomes "<|{role}|>\\n{content}\\n", followed
by "<|assistant|>\\n"; generation stops at the tokenizer's EOS or at "<|".
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
import uuid
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from prometheus_client import generate_latest
from pydantic import BaseModel, ConfigDict, Field

from laplace_jax.serve.engine import Engine, QueueFullError, SamplingParams
from laplace_jax.serve.engine import Request as EngineRequest
from laplace_jax.serve.metrics import ServeMetrics


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class _Common(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(default=1, ge=1)
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
    max_completion_tokens: int | None = Field(default=None, ge=1)


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, type_: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.type = status, message, param, type_


def _error(status: int, message: str, param: str | None = None, type_: str = "invalid_request_error", headers=None):
    body = {"error": {"message": message, "type": type_, "param": param, "code": status}}
    return JSONResponse(body, status_code=status, headers=headers)


def chat_prompt(messages: list[ChatMessage]) -> str:
    return "".join(f"<|{m.role}|>\n{m.content}\n" for m in messages) + "<|assistant|>\n"


class Server:
    """Holds the engine, tokenizer and metrics; ``app`` is the FastAPI application."""

    def __init__(self, engine: Engine, tokenizer: Any, model_name: str, defaults: SamplingParams | None = None):
        self.engine, self.tok, self.model_name = engine, tokenizer, model_name
        self.defaults = defaults or SamplingParams()
        self.metrics: ServeMetrics = engine.metrics
        self.warm_progress = "starting"
        self.created = int(time.time())
        self.thread = threading.Thread(target=self._run_engine, name="engine", daemon=True)
        self.app = self._build()

    def _run_engine(self) -> None:
        try:
            self.engine.warmup(progress=lambda msg: setattr(self, "warm_progress", msg))
        except Exception as e:  # reported on /health
            self.engine.dead = f"warmup failed: {e}"
            return
        self.engine.loop()

    # ----- request plumbing -------------------------------------------------------------
    def _sampling(self, body: _Common, max_tokens: int | None) -> SamplingParams:
        if body.n != 1:
            raise ApiError(400, "n > 1 is not supported; send separate requests", "n")
        if body.repetition_penalty != 1.0:
            raise ApiError(400, "repetition_penalty is not supported (only 1.0)", "repetition_penalty")
        d = self.defaults
        return SamplingParams(
            max_tokens=max_tokens or d.max_tokens,
            temperature=d.temperature if body.temperature is None else body.temperature,
            top_p=d.top_p if body.top_p is None else body.top_p,
            top_k=max(0, d.top_k if body.top_k is None else body.top_k),
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
        ids = [int(t) for t in prompt]
        if any(t < 0 or t >= self.engine.cfg.vocab_size for t in ids):
            raise ApiError(400, f"token ids must lie in [0, {self.engine.cfg.vocab_size})", "prompt")
        return ids

    async def _generate(self, request: Request, ids: list[int], sp: SamplingParams, stops: list[str]):
        """Async iterator of (text delta, finish_reason | None, completion tokens)."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()

        def emit(tokens: list[int], reason: str | None) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, (tokens, reason))

        req = EngineRequest(ids, sp, emit, id=uuid.uuid4().hex)
        try:
            self.engine.submit(req)
        except QueueFullError as e:
            raise ApiError(429, f"server busy: {e}", None, "rate_limit_error") from e
        except ValueError as e:
            raise ApiError(400, str(e), "prompt") from e
        out: list[int] = []
        sent = ""
        try:
            while True:
                try:
                    tokens, reason = await asyncio.wait_for(queue.get(), timeout=0.5)
                except TimeoutError:
                    if await request.is_disconnected():
                        return
                    continue
                out += tokens
                text = self.tok.decode(out)
                hit = min((i for i in (text.find(s) for s in stops) if i >= 0), default=-1)
                if hit >= 0:
                    text, reason = text[:hit], "stop"
                    req.cancelled = True
                elif reason is None and text.endswith("\ufffd"):
                    continue  # an incomplete multi-byte character: wait for the rest
                delta, sent = text[len(sent) :], text
                if reason == "error":
                    raise ApiError(500, f"the engine failed: {self.engine.dead}", None, "server_error")
                if reason in ("stop", "length", "abort"):
                    self.metrics.on_finish(req, reason, len(out))
                    yield delta, ("stop" if reason == "abort" else reason), len(out)
                    return
                if delta:
                    yield delta, None, len(out)
        finally:
            req.cancelled = True  # client gone or request over: the engine frees the slot next call

    async def _respond(
        self, request: Request, body: _Common, ids: list[int], sp: SamplingParams, chat: bool, prefix: str = ""
    ):
        stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        if chat:
            stops.append("<|")
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())
        gen = self._generate(request, ids, sp, stops)
        try:
            first = await anext(gen)  # raises ApiError (429/400) before any response is sent
        except StopAsyncIteration:  # the client left before the first token
            return JSONResponse({}, status_code=499)

        def usage(n: int) -> dict:
            return {"prompt_tokens": len(ids), "completion_tokens": n, "total_tokens": len(ids) + n}

        if not body.stream:
            text, reason, n = first
            async for delta, r, n in gen:  # noqa: B007 - n is the final count
                text, reason = text + delta, r
            text = prefix + text
            if chat:
                choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": reason}
            else:
                choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}
            obj = "chat.completion" if chat else "text_completion"
            return JSONResponse(
                {
                    "id": rid,
                    "object": obj,
                    "created": created,
                    "model": self.model_name,
                    "choices": [choice],
                    "usage": usage(n),
                }
            )

        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        obj = "chat.completion.chunk" if chat else "text_completion"

        def chunk(delta: str, reason: str | None, role: bool = False) -> str:
            if chat:
                d = {"role": "assistant", "content": delta} if role else {"content": delta}
                choice = {"index": 0, "delta": d, "finish_reason": reason}
            else:
                choice = {"index": 0, "text": delta, "logprobs": None, "finish_reason": reason}
            payload = {"id": rid, "object": obj, "created": created, "model": self.model_name, "choices": [choice]}
            return f"data: {json.dumps(payload)}\n\n"

        async def events():
            delta, reason, n = first
            yield chunk(prefix + delta, reason, role=True)
            async for delta, reason, n in gen:  # noqa: B007 - n is the final count
                yield chunk(delta, reason)
            if include_usage:
                payload = {
                    "id": rid,
                    "object": obj,
                    "created": created,
                    "model": self.model_name,
                    "choices": [],
                    "usage": usage(n),
                }
                yield f"data: {json.dumps(payload)}\n\n"
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
            await asyncio.to_thread(self.engine.stop, True, 30.0)  # SIGTERM: drain in-flight requests

        app = FastAPI(title="laplace-jax", lifespan=lifespan)

        @app.exception_handler(RequestValidationError)
        async def _invalid(_, exc: RequestValidationError):
            err = exc.errors()[0] if exc.errors() else {}
            loc = [str(x) for x in err.get("loc", []) if x != "body"]
            param = ".".join(loc) or None
            if err.get("type") == "extra_forbidden":
                return _error(400, f"unknown parameter {param!r}", param)
            if err.get("type") == "json_invalid":
                return _error(400, "the request body is not valid JSON", None)
            return _error(400, f"{param or 'body'}: {err.get('msg', 'invalid value')}", param)

        @app.exception_handler(ApiError)
        async def _api(_, exc: ApiError):
            headers = {"Retry-After": "1"} if exc.status == 429 else None
            return _error(exc.status, exc.message, exc.param, exc.type, headers)

        def ready_or_503():
            if self.engine.dead:
                raise ApiError(503, f"engine failed: {self.engine.dead}", None, "server_error")
            if not self.engine.ready:
                raise ApiError(503, f"warming up: {self.warm_progress}", None, "server_error")

        @app.get("/health")
        async def health():
            if self.engine.dead:
                return _error(503, f"engine failed: {self.engine.dead}", None, "server_error")
            if not self.engine.ready:
                return _error(503, f"warming up: {self.warm_progress}", None, "server_error")
            return {"status": "ok"}

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
            return PlainTextResponse(
                generate_latest(self.metrics.registry).decode(), media_type="text/plain; version=0.0.4"
            )

        @app.post("/v1/completions")
        async def completions(request: Request, body: CompletionRequest):
            ready_or_503()
            self._check_model(body.model)
            if body.logprobs is not None:
                raise ApiError(400, "logprobs are not supported", "logprobs")
            ids = self._prompt_ids(body.prompt)
            prefix = self.tok.decode(ids) if body.echo else ""
            return await self._respond(request, body, ids, self._sampling(body, body.max_tokens), False, prefix)

        @app.post("/v1/chat/completions")
        async def chat(request: Request, body: ChatRequest):
            ready_or_503()
            self._check_model(body.model)
            ids = self.tok.encode(chat_prompt(body.messages))
            sp = self._sampling(body, body.max_completion_tokens or body.max_tokens)
            return await self._respond(request, body, ids, sp, True)

        return app


class BackgroundServer:
    """Run a ``Server`` with uvicorn in a thread on a loopback port (tests, benchmarks, notebooks)."""

    def __init__(self, server: Server, port: int, host: str = "127.0.0.1", ready_timeout: float = 600.0):
        import httpx
        import uvicorn

        self.server, self.url = server, f"http://{host}:{port}"
        self.uv = uvicorn.Server(uvicorn.Config(server.app, host=host, port=port, log_level="error"))
        self.thread = threading.Thread(target=self.uv.run, daemon=True)
        t0 = time.perf_counter()
        self.thread.start()
        while time.perf_counter() - t0 < ready_timeout:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.url + "/health").status_code == 200:
                    self.ready_seconds = time.perf_counter() - t0
                    return
            if server.engine.dead:
                raise RuntimeError(server.engine.dead)
            time.sleep(0.1)
        raise TimeoutError(f"server not ready after {ready_timeout} s ({server.warm_progress})")

    def close(self) -> None:
        self.uv.should_exit = True
        self.thread.join(60)
