"""The HTTP routes (FastAPI): OpenAI's /v1/completions, /v1/chat/completions, /v1/models, vLLM's
/tokenize, /detokenize, /tokenizer_info, /version, /health, /metrics (ours and vLLM's names), and
what routers ask a worker (``worker_routes.py``).

The engine runs in its own thread; results reach asyncio through ``loop.call_soon_threadsafe``.
Request bodies are parsed, validated and tokenized in worker threads, so a large prompt never
stalls the event loop. Every error the server emits uses OpenAI's envelope
{"error": {message, type, param, code}}.

Generation itself (sequences, sampling, whole and streamed responses) is ``generation.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import difflib
import importlib.metadata
import json
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pydantic
from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse
from prometheus_client import generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from laplace_jax.errors import UserError
from laplace_jax.profiling import Trace
from laplace_jax.serve import protocol as pr
from laplace_jax.serve.engine import Engine
from laplace_jax.serve.generation import Generation
from laplace_jax.serve.grammars import Grammars
from laplace_jax.serve.metrics import ServeMetrics
from laplace_jax.serve.middleware import Boundary
from laplace_jax.serve.protocol import ApiError
from laplace_jax.serve.request import SamplingParams
from laplace_jax.serve.worker_routes import add_worker_routes, model_fingerprint

MAX_PROMPTS = 64  # prompts in one completions request
PARSERS = 2  # threads that parse and tokenize request bodies (Server.off_loop)
TAGS = {"str", "int", "float", "bool", "list", "dict"}  # pydantic's names of union members in an error's loc


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
        errors = e.errors()
        # a union field (stop: a string or a list of them) fails once per member: report the member
        # whose type matched, whose error says what is wrong with the value
        err = next((x for x in errors if not x.get("type", "").endswith("_type")), errors[0])
        # a required field missing beside an unknown one near its name ({"promt": ...}): the typo
        missing = [str(x["loc"][0]) for x in errors if x.get("type") == "missing" and len(x["loc"]) == 1]
        typo = [
            x
            for x in errors
            if x.get("type") == "extra_forbidden"
            and len(x["loc"]) == 1
            and difflib.get_close_matches(str(x["loc"][0]), missing, n=1)
        ]
        err = typo[0] if typo else err
        loc = tuple(x for x in err.get("loc", ()) if not (isinstance(x, str) and ("[" in x or "-" in x or x in TAGS)))
        if err.get("type") == "extra_forbidden":
            param = ".".join(str(x) for x in loc) or None
            raise ApiError(400, _unknown(param, loc, model), param) from None
        where = ".".join(str(x) for x in loc) or "body"
        message = err.get("msg", "invalid value").removeprefix("Value error, ")
        raise ApiError(400, f"{where}: {message}", str(loc[0]) if loc else None) from None
    except RecursionError:
        raise ApiError(400, "the request body is nested too deeply") from None


UNSUPPORTED = {  # fields OpenAI or vLLM clients send that this server does not implement, and why
    "functions": "legacy function calling (send tools and tool_choice)",
    "function_call": "legacy function calling (send tools and tool_choice)",
    "audio": "audio output",
    "modalities": "audio output",
    "use_beam_search": "beam search (n, best_of and seeds sample instead)",
    "length_penalty": "beam search",
    "early_stopping": "beam search",
    "allowed_token_ids": "token allow-lists (logit_bias of -100 excludes a token)",
    "bad_words": "bad-word lists (logit_bias of -100 excludes a token)",
    "logits_processors": "custom logits processors",
    "truncate_prompt_tokens": "prompt truncation (a prompt past max_model_len is refused whole)",
    "spaces_between_special_tokens": "detokenizer options (special tokens are never emitted)",
    "priority": "request priorities (requests are admitted in arrival order)",
    "cache_salt": "prefix-cache salts (the prefix cache is per server)",
    "kv_transfer_params": "disaggregated prefill (there is no KV cache: a sequence's state is fixed-size)",
    "vllm_xargs": "vLLM's extension arguments",
    "mm_processor_kwargs": "multimodal input",
    "chat_template": "custom chat templates (the template is fixed: /tokenizer_info shows it)",
    "chat_template_kwargs": "custom chat templates",
    "add_generation_prompt": "chat prompts without the assistant marker",
    "documents": "retrieval documents",
    "reasoning_effort": "reasoning models",
    "include_reasoning": "reasoning models",
    "prediction": "predicted outputs",
    "web_search_options": "web search",
    "service_tier": "service tiers",
    "store": "stored completions",
    "metadata": "stored completions",
    "prompt_logprobs": "vLLM's prompt_logprobs (send echo with logprobs: OpenAI's form of the same scores)",
    "add_special_tokens": "special-token insertion (a prompt is tokenized as it is)",
    "echo": "echo in chat (the completions route echoes)",
}


RENAMED = {  # vLLM's older spellings of fields this server takes under their current names
    "guided_json": "structured_outputs.json",
    "guided_regex": "structured_outputs.regex",
    "guided_choice": "structured_outputs.choice",
    "guided_grammar": "structured_outputs.grammar",
    "guided_whitespace_pattern": "structured_outputs.whitespace_pattern",
    "guided_decoding_backend": "structured_outputs (the backend is the server's)",
}


def _unknown(param: str | None, loc: tuple, model: type[pydantic.BaseModel]) -> str:
    """Why a field is refused: not supported (a known OpenAI feature), renamed, or a misspelling
    (with the nearest field name), or simply unknown."""
    if len(loc) == 1 and param in RENAMED:
        return f"{param!r} is vLLM's older spelling: send {RENAMED[param]}"
    if len(loc) == 1 and param in UNSUPPORTED:
        return f"{param!r} is not supported: this server does no {UNSUPPORTED[param]}"
    known = model.model_fields if len(loc) == 1 else {}
    near = difflib.get_close_matches(str(param), list(known), n=1)
    return f"unknown parameter {param!r}" + (f"; did you mean {near[0]!r}?" if near else "")


class Server:
    """Holds the engine, tokenizer and metrics; ``app`` is the ASGI application.

    From ``engine.serve``: ``api_key``, required as ``Authorization: Bearer KEY`` on /v1/*,
    /tokenize, /detokenize and the profile routes (and /metrics with ``protect_metrics``);
    ``profile_dir``: POST /start_profile and /stop_profile (vLLM's routes) bracket a
    ``jax.profiler`` trace written there; ``drain_timeout``: the whole shutdown sequence, from the
    signal to the last byte, takes at most this long (``begin_shutdown``). ``log``: called with
    one line when warmup ends (serve.py prints it).
    """

    def __init__(
        self,
        engine: Engine,
        tokenizer: Any,
        model_name: str,
        log: Callable[[str], None] | None = None,
        weights_id: str = "",
    ):
        """The HTTP settings (auth, limits, drain, profiling, sampling defaults) are ``engine.serve``'s;
        ``weights_id``: see ``worker_routes.model_fingerprint``."""
        cfg = engine.serve
        self.engine, self.tok, self.model_name = engine, tokenizer, model_name
        self.fingerprint = model_fingerprint(engine, tokenizer, weights_id)
        self.trace = None if cfg.profile_dir is None else Trace(cfg.profile_dir)
        self._parsers = ThreadPoolExecutor(PARSERS, thread_name_prefix="parse")
        self.log = log
        defaults = SamplingParams(max_tokens=cfg.max_tokens, temperature=cfg.temperature, top_p=cfg.top_p)
        self.gen = Generation(engine, tokenizer, model_name, defaults, self.off_loop, Grammars(engine, tokenizer))
        self.metrics: ServeMetrics = engine.metrics
        self.metrics.export_vllm_names(model_name)
        self.drain_timeout = cfg.drain_timeout
        self.warm_progress = "starting"
        self.created = int(time.time())
        progress = lambda msg: setattr(self, "warm_progress", msg)  # noqa: E731
        self.thread = threading.Thread(target=engine.serve_forever, args=(progress, log), name="engine", daemon=True)
        self.app = Boundary(self._build(), cfg.api_key, cfg.protect_metrics, cfg.max_body_bytes, cfg.body_timeout)

    def begin_shutdown(self) -> None:
        """Stop admitting; requests still running near the end of ``drain_timeout`` finish with "length"."""
        margin = min(1.0, 0.2 * self.drain_timeout)  # time left for the last chunks to reach the clients
        self.engine.begin_drain(self.drain_timeout - margin)

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

    async def off_loop(self, fn: Callable, *args: Any) -> Any:
        """``fn(*args)`` on one of ``PARSERS`` threads (parsing, tokenizing): never on the event loop, and
        few at once, so a burst of large bodies holds the GIL from the loop (and /health) a bounded time."""
        return await asyncio.get_running_loop().run_in_executor(self._parsers, fn, *args)

    async def _body(self, request: Request, model: type[pydantic.BaseModel]):
        self._ready_or_503()
        return await self.off_loop(_parse, await request.body(), model)

    # ----- app ----------------------------------------------------------------------------
    def _build(self) -> FastAPI:
        @contextlib.asynccontextmanager
        async def lifespan(app):
            self.thread.start()
            yield
            self.begin_shutdown()  # no-op if a signal already started it (the earlier deadline wins)
            await asyncio.to_thread(self.engine.stop, True, self.drain_timeout)
            if self.log:
                m = self.metrics
                done, tokens = m.total(m.finished), m.total(m.generation_tokens)
                self.log(f"stopped: {done:,} requests finished, {tokens:,} tokens generated")

        app = FastAPI(title="laplace-jax", lifespan=lifespan)
        self._add_error_handlers(app)
        self._add_status_routes(app)
        add_worker_routes(app, self.engine, self.model_name, self.fingerprint)
        self._add_tokenizer_routes(app)
        self._add_generation_routes(app)
        self._add_profile_routes(app)
        build_spec = app.openapi

        def spec() -> dict:  # the stream chunk's schema too (no route returns it as JSON)
            out = build_spec()
            chunk = pr.ChatCompletionChunk.model_json_schema(ref_template="#/components/schemas/{model}")
            out["components"]["schemas"].update({**chunk.pop("$defs", {}), "ChatCompletionChunk": chunk})
            return out

        app.openapi = spec
        return app

    def _reply(self, exc: ApiError):
        self.metrics.errors.labels(exc.type).inc()
        headers = {"Retry-After": "1"} if exc.status == 429 else None
        return pr.error_response(exc.status, exc.message, exc.param, exc.type, headers)

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
                return pr.error_response(503, why, None, "server_error")
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

    def _add_profile_routes(self, app: FastAPI) -> None:
        async def toggle(action: str) -> Any:  # the trace's start or stop, off the event loop
            if self.trace is None:
                why = "profiling is off: start the server with --profile-dir DIR"
                raise ApiError(404, why, None, "not_found_error")
            try:
                return await asyncio.to_thread(getattr(self.trace, action))
            except UserError as e:
                raise ApiError(409, str(e)) from None

        @app.post("/start_profile")
        async def start_profile():
            await toggle("start")
            return {"status": "started", "dir": self.trace.directory}

        @app.post("/stop_profile")
        async def stop_profile():
            return {"status": "stopped", "trace": await toggle("stop")}

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
            body = await self.off_loop(_parse, await request.body(), pr.TokenizeRequest)
            self._check_model(body.model)
            if (body.prompt is None) == (body.messages is None):
                raise ApiError(400, "send exactly one of prompt and messages", "prompt")
            if body.prompt is not None:
                ids = await self.off_loop(self._encode, body.prompt, "prompt")
            else:
                ids = await self.off_loop(self._encode, pr.chat_prompt(body.messages), "messages")
            return {"count": len(ids), "max_model_len": self.engine.max_model_len, "tokens": ids}

        @app.post("/detokenize")
        async def detokenize(request: Request):
            body = await self.off_loop(_parse, await request.body(), pr.DetokenizeRequest)
            self._check_model(body.model)
            if any(not 0 <= t < self.tok.vocab_size for t in body.tokens):
                raise ApiError(400, f"tokens must lie in [0, {self.tok.vocab_size})", "tokens")
            return {"prompt": self.tok.decode(body.tokens)}

    def _add_generation_routes(self, app: FastAPI) -> None:
        @app.post("/v1/completions", response_model=pr.Completion)
        async def completions(request: Request):
            body: pr.CompletionRequest = await self._body(request, pr.CompletionRequest)
            self._check_model(body.model)
            sp = body.to_sampling_params(self.gen.defaults)
            prompts = await self.off_loop(self._prompts, body.prompt)
            return await self.gen.respond(request, body, prompts, sp, body.candidates(), chat=False, echo=body.echo)

        streamed = {"text/event-stream": {"schema": {"$ref": "#/components/schemas/ChatCompletionChunk"}}}

        @app.post("/v1/chat/completions", response_model=pr.ChatCompletion, responses={200: {"content": streamed}})
        async def chat(request: Request):
            body: pr.ChatRequest = await self._body(request, pr.ChatRequest)
            self._check_model(body.model)
            sp = body.to_sampling_params(self.gen.defaults)
            ids = await self.off_loop(self._encode, pr.chat_prompt(body.messages, body.shown_tools()), "messages")
            return await self.gen.respond(request, body, [ids], sp, body.n, chat=True, echo=False)
