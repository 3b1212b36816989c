"""Generation over HTTP: a completions or chat request's sequences from sampling parameters to
the response, whole or streamed as server-sent events.

One HTTP request may hold several sequences: a list of prompts, each with ``n`` choices (or
``best_of`` candidates ranked by cumulative logprob). Each prompt's sequences are one engine
group: prefilled once, the state copied into a slot per sequence. Choice ``index`` is
prompt_index * n + choice. The engine runs in its own thread; results reach asyncio through
``loop.call_soon_threadsafe``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel

from laplace_jax.errors import InvalidParamError, QueueFullError
from laplace_jax.serve import protocol as pr
from laplace_jax.serve.detok import TextStream
from laplace_jax.serve.engine import Engine
from laplace_jax.serve.grammars import Grammars
from laplace_jax.serve.metrics import ServeMetrics
from laplace_jax.serve.protocol import ApiError
from laplace_jax.serve.request import Request as EngineRequest
from laplace_jax.serve.request import SamplingParams

DISCONNECT_POLL_S = 0.05  # how often a waiting request checks that its client is still there
FINISH = {"shutdown": "length", "abort": "stop"}  # engine reasons -> OpenAI's finish_reason


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
    call_id: str = dataclasses.field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")  # a named tool call's


def _tool_delta(s: _Seq, delta: str, tools, first: bool) -> dict:
    """A chat delta's text as content, or as tool calls: a named call's arguments stream as they
    come (its first chunk names it); ``required``'s calls come whole with the last chunk."""
    if not tools:
        return {"content": delta}
    mode, name = tools
    if mode == "named":
        head = {"id": s.call_id, "type": "function", "function": {"name": name, "arguments": delta}}
        call = head if first else {"function": {"arguments": delta}}
        return {"tool_calls": [pr.ToolCallDelta(index=0, **call)]}
    if s.finish is None:
        return {}
    calls = pr.tool_calls(s.out, mode, name)
    if calls is None:  # cut short (length): the text as it is
        return {"content": s.out}
    deltas = [
        pr.ToolCallDelta(index=i, id=c.id, type=c.type, function=c.function.model_dump()) for i, c in enumerate(calls)
    ]
    return {"tool_calls": deltas}


class Generation:
    """Runs completions and chat requests on ``engine``: ``respond`` serves a request's
    ``SamplingParams`` (``defaults`` fill what a request leaves out: ``to_sampling_params``)."""

    def __init__(
        self,
        engine: Engine,
        tokenizer: Any,
        model_name: str,
        defaults: SamplingParams | None = None,
        off_loop: Callable[..., Awaitable[Any]] | None = None,
        grammars: Grammars | None = None,
    ):
        """``off_loop(fn, *args)``: where request checks run off the event loop (the server's bounded
        parser threads; ``asyncio.to_thread`` by default); ``grammars``: structured outputs' compiles."""
        self.engine, self.tok, self.model_name = engine, tokenizer, model_name
        self.grammars = grammars or Grammars(engine, tokenizer)
        self.off_loop = off_loop or asyncio.to_thread
        self.defaults = defaults or SamplingParams()
        self.metrics: ServeMetrics = engine.metrics

    def _groups(self, prompts, sp: SamplingParams, per_prompt: int, rank: bool, emit) -> list[list[EngineRequest]]:
        """One group of ``per_prompt`` sequences per prompt; member j samples with seed + j;
        ``rank``: keep each sequence's cumulative logprob (best_of)."""
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
        await self.off_loop(self._submit, groups)
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

    def _usage(self, prompts: list[list[int]], seqs: list[_Seq]) -> pr.Usage:
        p, c = sum(len(x) for x in prompts), sum(len(s.tokens) for s in seqs)
        return pr.Usage(prompt_tokens=p, completion_tokens=c, total_tokens=p + c)

    def _choice(
        self, s: _Seq, index: int, chat: bool, echo: bool, logprobs: int | None, tools=None
    ) -> pr.ChatChoice | pr.CompletionChoice:
        r = s.req
        gen, as_ids = r.logprobs[: len(s.tokens)], r.sampling.return_tokens_as_token_ids
        if chat:
            lp = pr.chat_logprobs(self.tok, s.tokens, gen, as_ids) if logprobs is not None else None
            calls = pr.tool_calls(s.out, *tools) if tools else None
            message = pr.AssistantMessage(role="assistant", content=None if calls else s.out, tool_calls=calls)
            finish = "tool_calls" if calls and tools[0] == "required" and s.finish == "stop" else s.finish
            return pr.ChatChoice(index=index, message=message, logprobs=lp, finish_reason=finish)
        prefix = self.tok.decode(r.prompt_ids) if echo else ""
        lp = None
        if logprobs is not None:
            ids, entries = s.tokens, gen
            if echo:
                ids, entries = r.prompt_ids + s.tokens, r.prompt_logprobs + gen
            lp = pr.completion_logprobs(self.tok, ids, entries, 0 if echo else len(prefix), as_ids)
        return pr.CompletionChoice(index=index, text=prefix + s.out, logprobs=lp, finish_reason=s.finish)

    async def _complete(self, request, prompts, sp, n, best_of, stops, include_stop, chat, echo, request_id, tools):
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
            choices += [self._choice(s, p * n + j, chat, echo, sp.logprobs, tools) for j, s in enumerate(mine)]
        kind = pr.ChatCompletion if chat else pr.Completion
        whole = kind(**self._head(kind, request_id), choices=choices, usage=self._usage(prompts, ordered))
        return JSONResponse(whole.model_dump(exclude_unset=True))

    def _head(self, kind: type[BaseModel], request_id: str | None) -> dict:
        """The fields every response and chunk of ``kind`` opens with (its ``object`` set, so a
        dump without unset fields keeps it); the id from the client's ``request_id`` (vLLM's)."""
        rid = ("chatcmpl-" if kind is not pr.Completion else "cmpl-") + (request_id or uuid.uuid4().hex[:24])
        obj = kind.model_fields["object"].default
        return {"id": rid, "object": obj, "created": int(time.time()), "model": self.model_name}

    async def _stream(
        self, request, prompts, sp, n, stops, include_stop, chat, echo, usage: str | None, request_id, tools
    ):
        """Server-sent events: a chunk per step and sequence (index = prompt * n + choice).
        ``usage``: None, "last" (a final chunk with the usage) or "every" (also in each chunk, so
        far: vLLM's ``continuous_usage_stats``). ``tools``: the text is tool calls' (``respond``)."""
        kind = pr.ChatCompletionChunk if chat else pr.Completion
        head = self._head(kind, request_id)
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
            index = s.prompt * n + s.ordinal
            as_ids = sp.return_tokens_as_token_ids
            if chat:
                d = pr.ChatDelta(
                    role="assistant" if started == 0 else None, **_tool_delta(s, delta, tools, started == 0)
                )
                lp = pr.chat_logprobs(self.tok, tokens, entries, as_ids) if sp.logprobs is not None else None
                finish = s.finish
                if tools and tools[0] == "required" and finish == "stop" and d.tool_calls:
                    finish = "tool_calls"
                choice = pr.ChatChunkChoice(index=index, delta=d, logprobs=lp, finish_reason=finish)
            else:
                if echo and started == 0:
                    delta = self.tok.decode(s.req.prompt_ids) + delta
                lp = None
                if sp.logprobs is not None:
                    lp = pr.completion_logprobs(self.tok, tokens, entries, len(s.out), as_ids)
                choice = pr.CompletionChoice(index=index, text=delta, logprobs=lp, finish_reason=s.finish)
            so_far = {"usage": self._usage(prompts, list(seqs.values()))} if usage == "every" else {}
            return pr.sse(kind(**head, choices=[choice], **so_far))

        async def events():
            yield chunk(*first)
            try:
                async for item in run:
                    yield chunk(*item)
            except ApiError as e:  # the response has started: report the failure in the stream
                self.metrics.errors.labels(e.type).inc()
                yield pr.sse(pr.envelope(e.status, e.message, e.param, e.type))
            else:
                if usage is not None:
                    last = kind(**head, choices=[], usage=self._usage(prompts, list(seqs.values())))
                    yield pr.sse(last)
            yield "data: [DONE]\n\n"

        async def guarded():
            try:
                async for e in events():
                    yield e
            finally:
                await run.aclose()

        return StreamingResponse(guarded(), media_type="text/event-stream")

    async def respond(self, request, body, prompts, sp: SamplingParams, per_prompt: int, chat: bool, echo: bool):
        """Serve ``prompts`` with ``per_prompt`` sequences each (``best_of`` or ``n``; the slots per
        device bound it, the engine's check), constrained to ``body.constraint()`` if any; a chat
        output of tool calls (``ChatRequest.tool_mode``) is returned as ``tool_calls``."""
        sp.automaton = await self.grammars.automaton(body.constraint())
        tools = body.tool_mode() if chat else None
        try:
            self.engine.check_group(per_prompt)
        except InvalidParamError as e:
            raise ApiError(400, str(e), e.param) from e
        stops = body.stops() + ([pr.CHAT_STOP] if chat else [])
        include = body.include_stop_str_in_output
        if body.stream:
            opts = body.stream_options
            usage = None if not (opts and opts.include_usage) else "every" if opts.continuous_usage_stats else "last"
            return await self._stream(
                request, prompts, sp, body.n, stops, include, chat, echo, usage, body.request_id, tools
            )
        return await self._complete(
            request, prompts, sp, body.n, per_prompt, stops, include, chat, echo, body.request_id, tools
        )
