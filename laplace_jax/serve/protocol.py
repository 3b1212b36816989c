"""The OpenAI / vLLM wire format: request schemas, the chat template, and the response pieces
(logprobs in the completions and the chat shapes, the error envelope and ``ApiError``).

Request schemas check types and ranges (field constraints, so ``/openapi.json`` states them) and
forbid unknown fields (400 naming the field); ``to_sampling_params`` turns a request into the
engine's ``SamplingParams``, and what depends on the served model (token ids against the
vocabulary, lengths against max_model_len, n against the slots) is the engine's own check at its
boundary (``Engine.submit``). Responses are typed too: ``Completion``, ``ChatCompletion`` and
their stream chunks.

Chat template (documented, simple): each message becomes "<|{role}|>\\n{content}\\n", followed
by "<|assistant|>\\n"; generation stops at the tokenizer's EOS or at "<|". The ``developer`` role
is rendered as ``system`` (OpenAI's newer name for it). With ``tools``, a "<|tools|>" turn holding
their definitions as JSON comes first; an assistant turn's tool calls follow its content as a
JSON list of {name, arguments}. "<|" inside content is written "<\\|",
so no message can forge a role marker.
"""

from __future__ import annotations

import json
import uuid
from typing import Annotated, Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, StringConstraints, ValidationInfo, field_validator

from laplace_jax.data.tokenizer import Tokenizer
from laplace_jax.sampling import TOP_LOGPROBS
from laplace_jax.serve.request import (
    MAX_LOGIT_BIAS,
    MAX_PENALTY,
    MAX_REPETITION_PENALTY,
    MAX_SEED,
    MAX_STOP_IDS,
    MAX_TEMPERATURE,
    SamplingParams,
    TokenLogprob,
)
from laplace_jax.serve.structured import Constraint

MAX_STOP_STRINGS, MAX_STOP_CHARS = 8, 256
ROLE_MARK, ESCAPED_MARK = "<|", "<\\|"
CHAT_STOP = ROLE_MARK
CHAT_TEMPLATE_JINJA = (  # the same template for clients that render it themselves (/tokenizer_info)
    "{% for m in messages %}<|{{ 'system' if m['role'] == 'developer' else m['role'] }}|>\n"
    "{{ m['content'] | replace('<|', '<\\\\|') }}\n{% endfor %}<|assistant|>\n"
)


# SGLang fields at the value that is refused, and why (any other value is what this server does)
NO_OP_FIELDS = {
    "no_stop_trim": (True, "stop strings are always trimmed (include_stop_str_in_output keeps them)"),
    "skip_special_tokens": (False, "special tokens are never emitted (EOS ends a sequence)"),
    "return_hidden_states": (True, "hidden states are not returned"),
    "continue_final_message": (True, "every chat prompt ends with the assistant marker"),
}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


def _range(default, lo=None, hi=None, *, lo_open=False):
    """A field in [lo, hi] (lo_open: (lo, hi]); floats must be finite."""
    bounds = {"gt" if lo_open else "ge": lo} if lo is not None else {}
    if hi is not None:
        bounds["le"] = hi
    return Field(default, **bounds)


StopString = Annotated[str, StringConstraints(min_length=1, max_length=MAX_STOP_CHARS)]
Finite = Annotated[float, Field(allow_inf_nan=False)]


class StreamOptions(_Strict):
    include_usage: bool = False  # a last chunk with the request's usage
    continuous_usage_stats: bool = False  # with include_usage: every chunk carries the usage so far (vLLM)


class StructuredOutputs(_Strict):
    """vLLM's ``structured_outputs``: exactly one of json, regex, choice, grammar, json_object."""

    json_: dict | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: Annotated[list[str], Field(min_length=1)] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False  # always so here: only a schema's own properties are generated
    whitespace_pattern: str | None = None

    def constraint(self, field: str = "structured_outputs") -> Constraint:
        given = [k for k in ("json", "regex", "choice", "grammar", "json_object") if getattr(self, _py(k))]
        if len(given) != 1:
            raise ApiError(400, f"{field}: send exactly one of json, regex, choice, grammar, json_object", field)
        kind = given[0]
        ws = "" if self.disable_any_whitespace else self.whitespace_pattern
        if kind == "grammar":
            return Constraint("grammar", self.grammar, None, f"{field}.grammar")
        if kind == "regex":
            return Constraint("regex", self.regex, None, f"{field}.regex")
        if kind == "choice":
            return Constraint("choice", json.dumps(self.choice), None, f"{field}.choice")
        if kind == "json_object":
            return Constraint("json_object", "", ws, f"{field}.json_object")
        return Constraint("json", _schema_text(self.json_, f"{field}.json"), ws, f"{field}.json")


def _py(name: str) -> str:
    return "json_" if name == "json" else name


def _schema_text(schema: dict | str, field: str) -> str:
    """A JSON schema as canonical JSON text; ApiError 400 if it is not a JSON object."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as e:
            raise ApiError(400, f"{field}: not valid JSON: {e}", field) from None
    if not isinstance(schema, dict):
        raise ApiError(400, f"{field}: a JSON schema must be an object", field)
    return json.dumps(schema, sort_keys=True)


class _Common(_Strict):
    model: str
    max_tokens: int | None = _range(None, 0)
    temperature: Finite | None = _range(None, 0.0, MAX_TEMPERATURE)
    top_p: Finite | None = _range(None, 0.0, 1.0, lo_open=True)
    top_k: int | None = _range(None, -1)  # -1 (vLLM) or 0: off; the top end is the model's
    min_p: Finite = _range(0.0, 0.0, 1.0)
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)] | None = None
    stop_token_ids: Annotated[list[Annotated[int, Field(ge=0)]], Field(max_length=MAX_STOP_IDS - 1)] | None = None
    include_stop_str_in_output: bool = False
    seed: int | None = _range(None, 0, MAX_SEED)
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = _range(1, 1)
    ignore_eos: bool = False
    min_tokens: int = _range(0, 0)
    presence_penalty: Finite = _range(0.0, -MAX_PENALTY, MAX_PENALTY)
    frequency_penalty: Finite = _range(0.0, -MAX_PENALTY, MAX_PENALTY)
    repetition_penalty: Finite = _range(1.0, 0.0, MAX_REPETITION_PENALTY, lo_open=True)
    logit_bias: dict[str, Annotated[Finite, Field(ge=-MAX_LOGIT_BIAS, le=MAX_LOGIT_BIAS)]] | None = None
    user: str | None = None
    return_tokens_as_token_ids: bool = False
    request_id: str | None = Field(None, max_length=128)  # vLLM: the response's id is built from it
    # SGLang's fields, which sglang-router adds to every request it forwards: accepted at the values
    # that ask for what this server does anyway, refused (with the reason) at any other
    no_stop_trim: bool = False
    skip_special_tokens: bool = True
    return_hidden_states: bool = False
    structured_outputs: StructuredOutputs | None = None

    @field_validator(
        "no_stop_trim", "skip_special_tokens", "return_hidden_states", "continue_final_message", check_fields=False
    )
    @classmethod
    def _no_op(cls, value: bool, info: ValidationInfo) -> bool:
        refused, why = NO_OP_FIELDS[info.field_name]
        if value == refused:
            raise ValueError(f"{str(value).lower()} is not supported: {why}")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _token_ids(cls, bias: dict[str, float] | None) -> dict[str, float] | None:
        for key in bias or {}:
            if not (key.isascii() and key.isdigit()):
                raise ValueError(f"logit_bias keys must be token ids; got {key!r}")
        return bias

    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def constraint(self) -> Constraint | None:
        """What the output must match (structured outputs), or None."""
        return self.structured_outputs and self.structured_outputs.constraint()

    def _sampling(self, defaults: SamplingParams, max_tokens: int | None, **kw) -> SamplingParams:
        d = self.top_k if self.top_k is not None else defaults.top_k
        return SamplingParams(
            max_tokens=defaults.max_tokens if max_tokens is None else max_tokens,
            temperature=defaults.temperature if self.temperature is None else self.temperature,
            top_p=defaults.top_p if self.top_p is None else self.top_p,
            top_k=0 if d == -1 else d,
            min_p=self.min_p,
            seed=self.seed,
            stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos,
            min_tokens=self.min_tokens,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            logit_bias={int(k): v for k, v in (self.logit_bias or {}).items()},
            return_tokens_as_token_ids=self.return_tokens_as_token_ids,
            **kw,
        )


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = _range(None, 0, TOP_LOGPROBS)
    echo: bool = False
    best_of: int | None = _range(None, 1)
    suffix: str | None = None

    def candidates(self) -> int:
        """Sequences per prompt: ``best_of`` (ranked, the likeliest ``n`` returned) or ``n``."""
        return self.n if self.best_of is None else self.best_of

    def to_sampling_params(self, defaults: SamplingParams) -> SamplingParams:
        """The engine's sampling parameters (``defaults`` fill what the request leaves out); raises
        ``ApiError`` for field combinations this server does not serve."""
        if self.suffix:
            raise ApiError(400, "suffix is not supported (no fill-in-the-middle training)", "suffix")
        if self.n > self.candidates():
            raise ApiError(400, f"need n <= best_of; got n={self.n}, best_of={self.best_of}", "n")
        if self.stream and self.candidates() > self.n:
            raise ApiError(400, "best_of > n cannot be streamed", "best_of")
        scored = self.echo and (self.logprobs is not None or self.max_tokens == 0)
        prompt_lp = (self.logprobs or 0) if scored else None  # the prompt is scored only to echo it
        return self._sampling(defaults, self.max_tokens, logprobs=self.logprobs, prompt_logprobs=prompt_lp)


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None  # None only for an assistant turn with tool_calls
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant turn that called tools (the calls as returned)
    tool_call_id: str | None = None  # a tool turn: the call it answers


class JsonSchemaFormat(_Strict):
    name: str = Field(max_length=64)
    description: str | None = None
    schema_: dict | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    def constraint(self) -> Constraint | None:
        if self.type == "text":
            return None
        if self.type == "json_object":
            return Constraint("json_object", "", None, "response_format")
        if self.json_schema is None:
            raise ApiError(400, "response_format: type json_schema needs json_schema", "response_format.json_schema")
        field = "response_format.json_schema.schema"
        return Constraint("json", _schema_text(self.json_schema.schema_ or {}, field), None, field)


class FunctionDef(_Strict):
    name: Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9_.-]{1,64}$")]
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDef


class FunctionName(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: FunctionName


AUTO_REFUSED = (
    "tool_choice 'auto' needs a model-specific tool-call format, which this model does not have: send "
    "'required' (the output is a list of calls) or name a function"
)
NO_PARAMETERS = {"type": "object", "properties": {}}


class ToolCallFunction(BaseModel):
    name: str
    arguments: str  # JSON text


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ToolCallDelta(BaseModel):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: dict[str, str]


class ChatRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    continue_final_message: bool = False  # sglang-router sends it (false); see _no_op
    separate_reasoning: bool = True  # sglang-router's reasoning switches: no reasoning parser runs,
    stream_reasoning: bool = True  # so either value serves the same
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = _range(None, 0, TOP_LOGPROBS)
    response_format: ResponseFormat | None = None
    tools: Annotated[list[Tool], Field(max_length=128)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True

    def shown_tools(self) -> list[Tool] | None:
        """The tools the prompt shows the model (none with tool_choice "none")."""
        return self.tools if self.tool_choice != "none" else None

    def tool_mode(self) -> tuple[str, str | None] | None:
        """("named", the function) or ("required", None) when the output is tool calls, else None."""
        choice = self.tool_choice
        if choice is None or choice == "none":
            return None
        if not self.tools:
            raise ApiError(400, "tool_choice needs tools", "tool_choice")
        if choice == "auto":
            raise ApiError(400, AUTO_REFUSED, "tool_choice")
        if choice == "required":
            return "required", None
        if choice.function.name not in {t.function.name for t in self.tools}:
            raise ApiError(400, f"tool_choice names {choice.function.name!r}, which is not in tools", "tool_choice")
        return "named", choice.function.name

    def constraint(self) -> Constraint | None:
        """What the output must match: the tool calls', the response format's or structured_outputs'
        (at most one of them)."""
        tools, fmt = self.tool_mode(), self.response_format and self.response_format.constraint()
        given = [x for x in (tools, fmt, self.structured_outputs) if x is not None]
        if len(given) > 1:
            raise ApiError(400, "send at most one of tool_choice, response_format and structured_outputs", None)
        if tools is not None:
            return Constraint("json", json.dumps(self.tool_schema(*tools), sort_keys=True), None, "tools")
        if fmt is not None:
            return fmt
        return self.structured_outputs and self.structured_outputs.constraint()

    def tool_schema(self, mode: str, name: str | None) -> dict:
        """The output's schema: the named function's parameters, or (required) an array of
        {name, parameters} objects, one branch per tool (one item without parallel_tool_calls)."""
        by_name = {t.function.name: t.function.parameters or NO_PARAMETERS for t in self.tools}
        if mode == "named":
            return by_name[name]
        call = [
            {
                "type": "object",
                "properties": {"name": {"const": n}, "parameters": p},
                "required": ["name", "parameters"],
            }
            for n, p in by_name.items()
        ]
        one = {} if self.parallel_tool_calls else {"maxItems": 1}
        return {"type": "array", "items": {"anyOf": call}, "minItems": 1, **one}

    def to_sampling_params(self, defaults: SamplingParams) -> SamplingParams:
        """The engine's sampling parameters (``defaults`` fill what the request leaves out); raises
        ``ApiError`` for field combinations this server does not serve."""
        if self.top_logprobs is not None and not self.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs: true", "top_logprobs")
        limit = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        sp = self._sampling(defaults, limit, logprobs=(self.top_logprobs or 0) if self.logprobs else None)
        if sp.max_tokens < 1:
            raise ApiError(400, f"max_completion_tokens must be >= 1; got {sp.max_tokens}", "max_completion_tokens")
        return sp


# ----- responses -------------------------------------------------------------------------------
class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    """Per token: its text, logprob (None: unscored, the prompt's first token), most likely
    alternatives (with the chosen one) and character offset."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None


class _Response(BaseModel):
    """What every response and stream chunk opens with; ``object`` names its kind."""

    id: str
    object: str
    created: int
    model: str


class Completion(_Response):
    """A /v1/completions response; streamed, each chunk has this shape (one choice, the text so
    far's delta) and ``usage`` only where ``stream_options`` asks for it."""

    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob]


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: str | None


class ChatCompletion(_Response):
    """A /v1/chat/completions response (not streamed)."""

    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]
    usage: Usage


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None  # in a sequence's first chunk only
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None
    finish_reason: str | None


class ChatCompletionChunk(_Response):
    """One server-sent event of a streamed chat completion; the last (with ``include_usage``)
    has no choices and the usage."""

    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class TokenizeRequest(_Strict):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = False
    add_generation_prompt: bool = True


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[int]


def tool_calls(text: str, mode: str, name: str | None) -> list[ToolCall] | None:
    """The tool calls an output holds: the named function's with the text as its arguments, or
    (``required``) one per item of the text's JSON list of {name, parameters}; None when the text
    is not such a list (generation was cut short)."""
    if mode == "named":
        return [ToolCall(id=_call_id(), type="function", function=ToolCallFunction(name=name, arguments=text))]
    try:
        items = json.loads(text)
        pairs = [(c["name"], json.dumps(c["parameters"])) for c in items]
    except (ValueError, TypeError, KeyError):
        return None
    return [ToolCall(id=_call_id(), type="function", function=ToolCallFunction(name=n, arguments=a)) for n, a in pairs]


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def envelope(status: int, message: str, param: str | None = None, type_: str = "invalid_request_error") -> dict:
    """OpenAI's error object."""
    return {"error": {"message": message, "type": type_, "param": param, "code": status}}


class ApiError(Exception):
    """An HTTP error the server answers in OpenAI's envelope: ``status``, ``message``, the
    ``param`` at fault and OpenAI's error ``type``."""

    def __init__(self, status: int, message: str, param: str | None = None, type_: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.type = status, message, param, type_


def error_response(
    status: int, message: str, param: str | None = None, type_: str = "invalid_request_error", headers=None
) -> JSONResponse:
    return JSONResponse(envelope(status, message, param, type_), status_code=status, headers=headers)


# Characters JSON leaves unescaped that many line splitters (Python's str.splitlines, so httpx's
# iter_lines) take for line ends; inside a JSON string their \\u escapes are the same text.
_LINE_BREAKING = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def sse(payload: BaseModel | dict) -> str:
    """One server-sent event carrying ``payload`` as JSON on a single line, whatever the text."""
    body = payload.model_dump_json(exclude_unset=True) if isinstance(payload, BaseModel) else json.dumps(payload)
    return f"data: {body.translate(_LINE_BREAKING)}\n\n"


def content_text(content: str | list[TextPart]) -> str:
    return content if isinstance(content, str) else "".join(p.text for p in content)


def chat_prompt(messages: list[ChatMessage], tools: list[Tool] | None = None) -> str:
    """The prompt text for ``messages`` (see the module docstring), after the tools' definitions."""
    out = [] if not tools else [_turn("tools", json.dumps([t.model_dump(exclude_none=True) for t in tools]))]
    for m in messages:
        role = "system" if m.role == "developer" else m.role
        text = content_text(m.content or "")
        if m.tool_calls:
            text += json.dumps([c.function.model_dump() for c in m.tool_calls])
        out.append(_turn(role, text))
    return "".join(out) + "<|assistant|>\n"


def _turn(role: str, text: str) -> str:
    return f"<|{role}|>\n{text.replace(ROLE_MARK, ESCAPED_MARK)}\n"


def encode_text(tok: Tokenizer, text: str) -> list[int]:
    """Token ids of ``text``, with the end token's text read as the end token (as Hugging Face
    tokenizers read special tokens). Raises ``UnicodeEncodeError`` for text that is not valid
    Unicode (a lone surrogate)."""
    text.encode("utf-8")  # lone surrogates cannot be tokenized: the caller answers 400
    ids: list[int] = []
    for i, part in enumerate(text.split(tok.eos_token)):
        if i:
            ids.append(tok.eos_id)
        ids.extend(tok.encode(part) if part else [])
    return ids


def token_text(tok: Tokenizer, token_id: int, as_id: bool = False) -> str:
    """A token's text in logprobs; ``as_id``: "token_id:<id>" (vLLM's return_tokens_as_token_ids)."""
    return f"token_id:{token_id}" if as_id else tok.decode([token_id])


def completion_logprobs(
    tok: Tokenizer, ids: list[int], entries: list[TokenLogprob | None], offset: int, as_ids: bool = False
) -> CompletionLogprobs:
    """The completions ``logprobs`` object for ``ids`` and their scores (None: unscored, the
    prompt's first token). ``top_logprobs`` holds the requested most likely tokens plus the chosen
    one (vLLM's convention); tokens whose text coincides keep the likelier entry. ``text_offset``
    counts characters from ``offset`` (of the tokens' text, also with ``as_ids``)."""
    tokens = [token_text(tok, t, as_ids) for t in ids]
    top: list[dict[str, float] | None] = []
    offsets = []
    for t, text, e in zip(ids, tokens, entries, strict=True):
        offsets.append(offset)
        offset += len(token_text(tok, t)) if as_ids else len(text)
        if e is None:
            top.append(None)
            continue
        d: dict[str, float] = {}
        for i, lp in zip(e[1], e[2], strict=True):
            d.setdefault(token_text(tok, i, as_ids), lp)
        d.setdefault(text, e[0])
        top.append(d)
    return CompletionLogprobs(
        tokens=tokens,
        token_logprobs=[None if e is None else e[0] for e in entries],
        top_logprobs=top,
        text_offset=offsets,
    )


def chat_logprobs(tok: Tokenizer, ids: list[int], entries: list[TokenLogprob], as_ids: bool = False) -> ChatLogprobs:
    """The chat ``logprobs`` object: {"content": [{token, logprob, bytes, top_logprobs}]}."""

    def item(token_id: int, lp: float) -> dict:
        text = token_text(tok, token_id, as_ids)
        return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}

    return ChatLogprobs(
        content=[
            ChatTokenLogprob(
                **item(t, e[0]), top_logprobs=[TopLogprob(**item(i, lp)) for i, lp in zip(*e[1:], strict=True)]
            )
            for t, e in zip(ids, entries, strict=True)
        ]
    )
