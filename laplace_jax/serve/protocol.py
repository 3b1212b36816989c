"""The OpenAI / vLLM wire format: request schemas, the chat template, and the response pieces
(logprobs in the completions and the chat shapes, the error envelope and ``ApiError``).

Schemas check types and forbid unknown fields (400 naming the field); value ranges are checked
in one place, ``SamplingParams.check`` / ``Engine.check``.

Chat template (documented, simple): each message becomes "<|{role}|>\\n{content}\\n", followed
by "<|assistant|>\\n"; generation stops at the tokenizer's EOS or at "<|". The ``developer`` role
is rendered as ``system`` (OpenAI's newer name for it). "<|" inside content is written "<\\|",
so no message can forge a role marker.
"""

from __future__ import annotations

from typing import Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from laplace_jax.data.tokenizer import Tokenizer
from laplace_jax.serve.request import TokenLogprob

ROLE_MARK, ESCAPED_MARK = "<|", "<\\|"
CHAT_STOP = ROLE_MARK
CHAT_TEMPLATE_JINJA = (  # the same template for clients that render it themselves (/tokenizer_info)
    "{% for m in messages %}<|{{ 'system' if m['role'] == 'developer' else m['role'] }}|>\n"
    "{{ m['content'] | replace('<|', '<\\\\|') }}\n{% endfor %}<|assistant|>\n"
)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Strict):
    include_usage: bool = False  # a last chunk with the request's usage
    continuous_usage_stats: bool = False  # with include_usage: every chunk carries the usage so far (vLLM)


class _Common(_Strict):
    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float = 0.0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    ignore_eos: bool = False
    min_tokens: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    return_tokens_as_token_ids: bool = False


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict | None = None


class ChatRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    response_format: ResponseFormat | None = None


class TokenizeRequest(_Strict):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = False
    add_generation_prompt: bool = True


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[int]


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


def content_text(content: str | list[TextPart]) -> str:
    return content if isinstance(content, str) else "".join(p.text for p in content)


def chat_prompt(messages: list[ChatMessage]) -> str:
    """The prompt text for ``messages`` (see the module docstring)."""
    out = []
    for m in messages:
        role = "system" if m.role == "developer" else m.role
        out.append(f"<|{role}|>\n{content_text(m.content).replace(ROLE_MARK, ESCAPED_MARK)}\n")
    return "".join(out) + "<|assistant|>\n"


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
) -> dict:
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
    return {
        "tokens": tokens,
        "token_logprobs": [None if e is None else e[0] for e in entries],
        "top_logprobs": top,
        "text_offset": offsets,
    }


def chat_logprobs(tok: Tokenizer, ids: list[int], entries: list[TokenLogprob], as_ids: bool = False) -> dict:
    """The chat ``logprobs`` object: {"content": [{token, logprob, bytes, top_logprobs}]}."""

    def item(token_id: int, lp: float) -> dict:
        text = token_text(tok, token_id, as_ids)
        return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}

    return {
        "content": [
            {**item(t, e[0]), "top_logprobs": [item(i, lp) for i, lp in zip(e[1], e[2], strict=True)]}
            for t, e in zip(ids, entries, strict=True)
        ]
    }
