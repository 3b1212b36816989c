"""The HTTP routes (FastAPI): OpenAI's /v1/completions, /v1/chat/completions, /v1/models, vLLM's
/tokenize, /detokenize, /tokenizer_info, /version, and /health, /metrics.

The engine runs in its own thread; results reach asyncio through ``loop.call_soon_threadsafe``.
Request bodies are parsed, validated and tokenized in worker threads, so a large prompt never
stalls the event loop. Every error the server emits uses OpenAI's envelope
{"error": {message, type, param, code}}.

One HTTP request may hold several sequences: a list of prompts, each with ``n`` choices (or
``best_of`` candidates ranked by cumulative logprob). Each prompt's sequences are one engine
group: prefilled once, the state copied into a slot per sequence. Choice ``index`` is
prompt_index * n + choice.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import importlib.metadata
import json
import threading
import time
import uuid
from typing import Any

import pydantic
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from prometheus_client import generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from laplace_jax.errors import InvalidParamError, QueueFullError
from laplace_jax.serve import protocol as pr
from laplace_jax.serve.detok import TextStream
from laplace_jax.serve.engine import Engine
from laplace_jax.serve.metrics import ServeMetrics
from laplace_jax.serve.middleware import Boundary
from laplace_jax.serve.request import Request as EngineRequest
from laplace_jax.serve.request import SamplingParams

MAX_BODY_BYTES = 1 << 20  # default request body cap (413 above it)
BODY_TIMEOUT_S = 30.0  # a body that has not arrived by then gets 408
MAX_STOP_STRINGS, MAX_STOP_CHARS = 8, 256
MAX_PROMPTS = 64  # prompts in one completions request
DISCONNECT_POLL_S = 0.05  # how often a waiting request checks that its client is still there
FINISH = {"shutdown": "length", "abort": "stop"}  # engine reasons -> OpenAI's finish_reason


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, type_: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.type = status, message, param, type_


def _error(status: int, message: str, param: str | None = None, type_: str = "invalid_request_error", headers=None):
    return JSONResponse(pr.envelope(status, message, param, type_), status_code=status, headers=headers)


def _stop_strings(stop: str | list[str] | None) -> list[str]:
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if len(stops) > MAX_STOP_STRINGS:
        raise ApiError(400, f"at most {MAX_STOP_STRINGS} stop strings", "stop")
    if any(not 1 <= len(x) <= MAX_STOP_CHARS for x in stops):
        raise ApiError(400, f"each stop string must have 1 to {MAX_STOP_CHARS} characters", "stop")
    return stops


def _parse(raw: bytes, model: type[pydantic.BaseModel]) -> Any:
    """JSON body -> schema, or ApiError 400 naming what is wrong (runs in a worker thread)."""
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError):  # syntax, invalid UTF-8, nesting too deep
        raise ApiError(400, "the request body is not valid JSON") from None
    if not isinstance(data, dict):
        raise ApiError(400, "the request body must be a JSON object")
    try:
        return model.model_validate(data)
    except pydantic.ValidationError as e:
        err = e.errors()[0]
        param = ".".join(str(x) for x in err.get("loc", [])) or None
        if err.get("type") == "extra_forbidden":
            raise ApiError(400, f"unknown parameter {param!r}", param) from None
        raise ApiError(400, f"{param or 'body'}: {err.get('msg', 'invalid value')}", param) from None
    except RecursionError:
        raise ApiError(400, "the request body is nested too deeply") from None


@dataclasses.dataclass
class _Seq:
    """One sequence of an HTTP request, as the event loop follows it."""

    req: EngineRequest
    prompt: int  # index of its prompt
    ordinal: int  # its place among the prompt's sequences
    text: TextStream
    tokens: list[int] = dataclasses.field(default_factory=list)
    out: str = ""
    finish: str | None = None


class Server:
    """Holds the engine, tokenizer and metrics; ``app`` is the ASGI application.

    ``api_key``: required as ``Authorization: Bearer KEY`` on /v1/*, /tokenize and /detokenize
    (and /metrics with ``protect_metrics``). ``drain_timeout``: the whole shutdown sequence,
    from the signal to the last byte, takes at most this long (``begin_shutdown``).
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
        body_timeout: float = BODY_TIMEOUT_S,
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
        self.app = Boundary(self._build(), api_key, protect_metrics, max_body_bytes, body_timeout)

    def begin_shutdown(self) -> None:
        """Stop admitting; requests still running near the end of ``drain_timeout`` finish with "length"."""
        margin = min(1.0, 0.2 * self.drain_timeout)  # time left for the last chunks to reach the clients
        self.engine.begin_drain(self.drain_timeout - margin)

    # ----- request plumbing -------------------------------------------------------------
    def _sampling(self, body: pr._Common, max_tokens: int | None, logprobs: int | None, prompt_logprobs: int | None):
        d = self.defaults
        top_k = d.top_k if body.top_k is None else body.top_k
        try:
            bias = {int(k): float(v) for k, v in (body.logit_bias or {}).items()}
        except ValueError:
            raise ApiError(400, "logit_bias keys must be token ids", "logit_bias") from None
        return SamplingParams(
            max_tokens=d.max_tokens if max_tokens is None else max_tokens,
            temperature=d.temperature if body.temperature is None else body.temperature,
            top_p=d.top_p if body.top_p is None else body.top_p,
            top_k=0 if top_k == -1 else top_k,  # vLLM's -1 means off, like 0
            min_p=body.min_p,
            seed=body.seed,
            stop_token_ids=tuple(body.stop_token_ids or ()),
            ignore_eos=body.ignore_eos,
            min_tokens=body.min_tokens,
            presence_penalty=body.presence_penalty,
            frequency_penalty=body.frequency_penalty,
            repetition_penalty=body.repetition_penalty,
            logit_bias=bias,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            return_tokens_as_token_ids=body.return_tokens_as_token_ids,
        )

    def _check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise ApiError(
                404,
                f"model {name!r} does not exist; this server serves {self.model_name!r}",
                "model",
                "not_found_error",
            )

    def _encode(self, text: str, param: str) -> list[int]:
        try:
            return pr.encode_text(self.tok, text)
        except UnicodeEncodeError:
            raise ApiError(400, f"{param} is not valid Unicode text (a lone surrogate?)", param) from None

    def _prompts(self, prompt: str | list) -> list[list[int]]:
        """A completions ``prompt`` as token-id lists: a string, strings, token ids, or lists of them."""
        if isinstance(prompt, str):
            prompts = [self._encode(prompt, "prompt")]
        elif prompt and isinstance(prompt[0], str):
            prompts = [self._encode(p, "prompt") for p in prompt]
        elif prompt and isinstance(prompt[0], list):
            prompts = prompt
        else:
            prompts = [prompt]
        if not 1 <= len(prompts) <= MAX_PROMPTS:
            raise ApiError(400, f"send 1 to {MAX_PROMPTS} prompts per request; got {len(prompts)}", "prompt")
        return prompts

    async def _body(self, request: Request, model: type[pydantic.BaseModel]):
        self._ready_or_503()
        return await asyncio.to_thread(_parse, await request.body(), model)

    def _groups(self, prompts, sp: SamplingParams, per_prompt: int, rank: bool, emit) -> list[list[EngineRequest]]:
        """One group of ``per_prompt`` sequences per prompt; member j samples with seed + j;
        ``rank``: keep each sequence's cumulative logprob (best_of)."""
        try:
            sp.check(self.engine.vocab_size)  # before seeds are derived from it
        except InvalidParamError as e:
            raise ApiError(400, str(e), e.param) from e
        groups = []
        for p, ids in enumerate(prompts):
            group = []
            for j in range(per_prompt):
                seed = None if sp.seed is None else (sp.seed + j) % (2**63)
                i = p * per_prompt + j
                req = EngineRequest(ids, dataclasses.replace(sp, seed=seed), lambda t, r, i=i: emit(i, t, r))
                req.rank = rank
                group.append(req)
            groups.append(group)
        return groups

    def _submit(self, groups: list[list[EngineRequest]]) -> None:
        """Queue every group or none (runs in a worker thread: checking a long prompt takes time)."""
        done: list[EngineRequest] = []
        try:
            for g in groups:
                self.engine.submit(*g)
                done.extend(g)
        except QueueFullError as e:
            self.engine.cancel(*done)
            raise ApiError(429, f"server busy: {e}", None, "rate_limit_error") from e
        except InvalidParamError as e:
            self.engine.cancel(*done)
            raise ApiError(400, str(e), e.param) from e

    async def _watch(self, request: Request, reqs: list[EngineRequest], queue: asyncio.Queue) -> None:
        while not all(r.cancelled for r in reqs):
            if await request.is_disconnected():
                self.engine.cancel(*reqs)  # a queued request leaves the queue; a running one its slot
                queue.put_nowait((-1, [], "gone"))
                return
            await asyncio.sleep(DISCONNECT_POLL_S)

    async def _run(
        self, request: Request, prompts, sp: SamplingParams, per_prompt: int, stops, include_stop, rank=False
    ):
        """Async iterator of (sequence, text delta, new token ids) as sequences advance; a
        sequence's ``finish`` is set on its last item. Raises ``ApiError`` (400/429 before the
        first item; 500 if the engine ends a sequence with an error). Returns early when the
        client went away."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()

        def emit(i: int, tokens: list[int], reason: str | None) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, (i, tokens, reason))

        groups = self._groups(prompts, sp, per_prompt, rank, emit)
        seqs = [
            _Seq(r, p, j, TextStream(self.tok, stops, r.prompt_ids))
            for p, g in enumerate(groups)
            for j, r in enumerate(g)
        ]
        await asyncio.to_thread(self._submit, groups)
        reqs = [s.req for s in seqs]
        watcher = asyncio.create_task(self._watch(request, reqs, queue))
        left = len(seqs)
        try:
            while left:
                i, tokens, reason = await queue.get()
                if reason == "gone":
                    return
                s = seqs[i]
                if s.finish is not None:
                    continue
                if reason == "error":
                    raise ApiError(500, s.req.error or "the request failed", None, "server_error")
                s.tokens += tokens
                delta, hit = s.text.push(tokens)
                if reason is not None and not hit:
                    rest, hit = s.text.finish()
                    delta += rest
                if hit:
                    self.engine.cancel(s.req)  # a stop string: the engine frees the slot next call
                    delta += s.text.matcher.matched if include_stop else ""
                    reason = "stop"
                if reason is not None:
                    s.finish = FINISH.get(reason, reason)
                    self.metrics.on_finish(s.req, s.finish, len(s.tokens))
                    left -= 1
                s.out += delta
                if delta or tokens or reason:
                    yield s, delta, tokens
        finally:
            self.engine.cancel(*reqs)  # client gone or request over: the engine frees the slots next call
            watcher.cancel()

    # ----- responses ----------------------------------------------------------------------
    def _usage(self, prompts: list[list[int]], seqs: list[_Seq]) -> dict:
        p, c = sum(len(x) for x in prompts), sum(len(s.tokens) for s in seqs)
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}

    def _choice(self, s: _Seq, index: int, chat: bool, echo: bool, logprobs: int | None) -> dict:
        r = s.req
        gen, as_ids = r.logprobs[: len(s.tokens)], r.sampling.return_tokens_as_token_ids
        if chat:
            lp = pr.chat_logprobs(self.tok, s.tokens, gen, as_ids) if logprobs is not None else None
            message = {"role": "assistant", "content": s.out}
            return {"index": index, "message": message, "logprobs": lp, "finish_reason": s.finish}
        prefix = self.tok.decode(r.prompt_ids) if echo else ""
        lp = None
        if logprobs is not None:
            ids, entries = s.tokens, gen
            if echo:
                ids, entries = r.prompt_ids + s.tokens, r.prompt_logprobs + gen
            lp = pr.completion_logprobs(self.tok, ids, entries, 0 if echo else len(prefix), as_ids)
        return {"index": index, "text": prefix + s.out, "logprobs": lp, "finish_reason": s.finish}

    async def _complete(self, request, prompts, sp, n, best_of, stops, include_stop, chat, echo):
        """A whole (non-streamed) response; with best_of > n, each prompt's n likeliest sequences."""
        seqs: dict[int, _Seq] = {}
        async for s, _, _ in self._run(request, prompts, sp, best_of, stops, include_stop, best_of > n):
            seqs[id(s)] = s
        ordered = sorted(seqs.values(), key=lambda s: s.prompt)
        if len(ordered) < len(prompts) * best_of or any(s.finish is None for s in ordered):
            return JSONResponse({}, status_code=499)  # the client left: nobody reads this
        choices = []
        for p in range(len(prompts)):
            mine = [s for s in ordered if s.prompt == p]
            if best_of > n:
                mine = sorted(mine, key=lambda s: -s.req.cumulative_logprob)[:n]
            choices += [self._choice(s, p * n + j, chat, echo, sp.logprobs) for j, s in enumerate(mine)]
        kind = "chat.completion" if chat else "text_completion"
        return JSONResponse({**self._head(kind), "choices": choices, "usage": self._usage(prompts, ordered)})

    def _head(self, kind: str) -> dict:
        rid = ("chatcmpl-" if kind.startswith("chat") else "cmpl-") + uuid.uuid4().hex[:24]
        return {"id": rid, "object": kind, "created": int(time.time()), "model": self.model_name}

    async def _stream(self, request, prompts, sp, n, stops, include_stop, chat, echo, include_usage):
        """Server-sent events: a chunk per step and sequence (index = prompt * n + choice)."""
        head = self._head("chat.completion.chunk" if chat else "text_completion")
        run = self._run(request, prompts, sp, n, stops, include_stop)
        try:
            first = await anext(run)  # raises ApiError (400/429/500) before any response is sent
        except StopAsyncIteration:  # the client left before the first token
            return JSONResponse({}, status_code=499)
        seqs: dict[int, _Seq] = {}

        def chunk(s: _Seq, delta: str, tokens: list[int]) -> str:
            seqs[id(s)] = s
            started = len(s.tokens) - len(tokens)
            entries = s.req.logprobs[started : len(s.tokens)]
            if chat:
                d = {"content": delta} | ({"role": "assistant"} if started == 0 else {})
                as_ids = sp.return_tokens_as_token_ids
                lp = pr.chat_logprobs(self.tok, tokens, entries, as_ids) if sp.logprobs is not None else None
                choice = {"index": 0, "delta": d, "logprobs": lp, "finish_reason": s.finish}
            else:
                if echo and started == 0:
                    delta = self.tok.decode(s.req.prompt_ids) + delta
                lp = None
                if sp.logprobs is not None:
                    lp = pr.completion_logprobs(self.tok, tokens, entries, len(s.out), sp.return_tokens_as_token_ids)
                choice = {"index": 0, "text": delta, "logprobs": lp, "finish_reason": s.finish}
            choice["index"] = s.prompt * n + s.ordinal
            return f"data: {json.dumps({**head, 'choices': [choice]})}\n\n"

        async def events():
            yield chunk(*first)
            try:
                async for item in run:
                    yield chunk(*item)
            except ApiError as e:  # the response has started: report the failure in the stream
                self.metrics.errors.labels(e.type).inc()
                yield f"data: {json.dumps(pr.envelope(e.status, e.message, e.param, e.type))}\n\n"
            else:
                if include_usage:
                    usage = self._usage(prompts, list(seqs.values()))
                    yield f"data: {json.dumps({**head, 'choices': [], 'usage': usage})}\n\n"
            yield "data: [DONE]\n\n"

        async def guarded():
            try:
                async for e in events():
                    yield e
            finally:
                await run.aclose()

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
        self._add_tokenizer_routes(app)
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
        @app.exception_handler(ApiError)
        async def _api(_, exc: ApiError):
            return self._reply(exc)

        @app.exception_handler(StarletteHTTPException)
        async def _http(request: Request, exc: StarletteHTTPException):  # 404, 405 and the like
            type_ = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
            message = f"{request.method} {request.url.path}: {exc.detail}"
            return self._reply(ApiError(exc.status_code, message, None, type_))

    def _add_status_routes(self, app: FastAPI) -> None:
        @app.get("/health")
        async def health():
            if (why := self._not_ready()) is not None:
                return _error(503, why, None, "server_error")
            return {"status": "ok", "restarts": self.engine.restarts}

        @app.get("/version")
        async def version():
            return {"version": importlib.metadata.version("laplace-jax")}

        def card() -> dict:
            return {
                "id": self.model_name,
                "object": "model",
                "created": self.created,
                "owned_by": "laplace-jax",
                "root": self.model_name,
                "max_model_len": self.engine.max_model_len,
            }

        @app.get("/v1/models")
        async def models():
            return {"object": "list", "data": [card()]}

        @app.get("/v1/models/{model_id:path}")
        async def model(model_id: str):
            self._check_model(model_id)
            return card()

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

    def _add_tokenizer_routes(self, app: FastAPI) -> None:
        @app.get("/tokenizer_info")
        async def tokenizer_info():
            return {
                "tokenizer_class": type(self.tok).__name__,
                "eos_token": self.tok.eos_token,
                "bos_token": None,
                "pad_token": None,
                "chat_template": pr.CHAT_TEMPLATE_JINJA,
                "model_max_length": self.engine.max_model_len,
                "vocab_size": self.tok.vocab_size,
            }

        @app.post("/tokenize")
        async def tokenize(request: Request):
            body = await asyncio.to_thread(_parse, await request.body(), pr.TokenizeRequest)
            self._check_model(body.model)
            if (body.prompt is None) == (body.messages is None):
                raise ApiError(400, "send exactly one of prompt and messages", "prompt")
            if body.prompt is not None:
                ids = await asyncio.to_thread(self._encode, body.prompt, "prompt")
            else:
                ids = await asyncio.to_thread(self._encode, pr.chat_prompt(body.messages), "messages")
            return {"count": len(ids), "max_model_len": self.engine.max_model_len, "tokens": ids}

        @app.post("/detokenize")
        async def detokenize(request: Request):
            body = await asyncio.to_thread(_parse, await request.body(), pr.DetokenizeRequest)
            self._check_model(body.model)
            if any(not 0 <= t < self.tok.vocab_size for t in body.tokens):
                raise ApiError(400, f"tokens must lie in [0, {self.tok.vocab_size})", "tokens")
            return {"prompt": self.tok.decode(body.tokens)}

    def _add_generation_routes(self, app: FastAPI) -> None:
        @app.post("/v1/completions")
        async def completions(request: Request):
            body: pr.CompletionRequest = await self._body(request, pr.CompletionRequest)
            self._check_model(body.model)
            if body.suffix:
                raise ApiError(400, "suffix is not supported (no fill-in-the-middle training)", "suffix")
            best_of = body.n if body.best_of is None else body.best_of
            if body.stream and best_of > body.n:
                raise ApiError(400, "best_of > n cannot be streamed", "best_of")
            prompts = await asyncio.to_thread(self._prompts, body.prompt)
            scored = body.echo and (body.logprobs is not None or body.max_tokens == 0)
            prompt_lp = (body.logprobs or 0) if scored else None  # the prompt is scored only to echo it
            sp = self._sampling(body, body.max_tokens, body.logprobs, prompt_lp)
            return await self._respond(request, body, prompts, sp, best_of, chat=False, echo=body.echo)

        @app.post("/v1/chat/completions")
        async def chat(request: Request):
            body: pr.ChatRequest = await self._body(request, pr.ChatRequest)
            self._check_model(body.model)
            if body.response_format is not None and body.response_format.type != "text":
                raise ApiError(400, "response_format: only 'text' is supported", "response_format")
            if body.top_logprobs is not None and not body.logprobs:
                raise ApiError(400, "top_logprobs needs logprobs: true", "top_logprobs")
            limit = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
            ids = await asyncio.to_thread(self._encode, pr.chat_prompt(body.messages), "messages")
            sp = self._sampling(body, limit, (body.top_logprobs or 0) if body.logprobs else None, None)
            if sp.max_tokens < 1:
                raise ApiError(400, f"max_completion_tokens must be >= 1; got {sp.max_tokens}", "max_completion_tokens")
            return await self._respond(request, body, [ids], sp, body.n, chat=True, echo=False)

    async def _respond(self, request, body, prompts, sp: SamplingParams, best_of: int, chat: bool, echo: bool):
        slots = self.engine.slots_per_device
        if not 1 <= body.n <= best_of <= slots:
            param = "best_of" if getattr(body, "best_of", None) is not None and 1 <= body.n <= best_of else "n"
            raise ApiError(
                400, f"need 1 <= n <= best_of <= {slots} (slots per device); got n={body.n}, best_of={best_of}", param
            )
        stops = _stop_strings(body.stop) + ([pr.CHAT_STOP] if chat else [])
        include = body.include_stop_str_in_output
        if body.stream:
            usage = bool(body.stream_options and body.stream_options.include_usage)
            return await self._stream(request, prompts, sp, body.n, stops, include, chat, echo, usage)
        return await self._complete(request, prompts, sp, body.n, best_of, stops, include, chat, echo)
