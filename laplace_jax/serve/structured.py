"""Structured outputs: what a request constrains its output to (a JSON schema, a regular
expression, a list of choices, a Lark grammar), compiled to a token automaton that the decode loop
masks and advances on device, or, past the automaton's reach, to a grammar whose masks the host
computes per token.

A ``Constraint`` is the request's side (kind, source, whitespace); ``Compiler.compile`` turns it
into a ``TokenAutomaton``: ``table[s, t]`` is the state after token t in state s, -1 where t is
not allowed; state 0 is the start; EOS is allowed (a self-loop) in accepting states only. States
from which no accepting state can be reached are removed, so every state allows at least one
token and the device never samples from a row the grammar forbids entirely.

The backend (``Backend``) turns a constraint into a regular expression and the expression into
the automaton over the vocabulary's token bytes; ``OutlinesCore`` does both with outlines-core
(its ``build_regex_from_schema`` and ``Index``). A Lark grammar, and a JSON schema with keywords
a regular expression cannot enforce (``UNENFORCED``: numeric bounds, ``multipleOf``, property
counts), compile instead to a ``HostGrammar`` (``LLGuidance``: llguidance's parser, which
gives the allowed tokens of each step): the scheduler keeps one matcher per request and writes
each next mask into two table rows of its own (``serve/scheduler.py``). Compiled constraints are
cached by the constraint's hash, within a byte budget.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import json
import re
import threading
import time
from typing import Any, Literal, Protocol

import numpy as np

from laplace_jax.errors import InvalidParamError

# json_object: any JSON object (``json_object_regex``); grammar: Lark (llguidance's dialect)
Kind = Literal["json", "regex", "choice", "json_object", "grammar"]

# JSON Schema keywords the regex backend cannot enforce: a schema using one is served by host masks
# (llguidance), which enforce the numeric bounds and property counts and refuse the rest by name,
# so an output never fails validation against its own schema
UNENFORCED = frozenset(
    {
        "minimum",
        "maximum",
        "exclusiveMinimum",
        "exclusiveMaximum",
        "multipleOf",
        "uniqueItems",
        "not",
        "if",
        "then",
        "else",
        "patternProperties",
        "dependentRequired",
        "dependentSchemas",
        "minProperties",
        "maxProperties",
        "contains",
    }
)
MAX_SOURCE_CHARS = 65_536  # a schema, regex or choice list longer than this is refused before compiling


@dataclasses.dataclass(frozen=True)
class Constraint:
    """What the output must match: ``kind`` and its ``source`` (a schema as JSON text, a regex, or
    the choices as a JSON list); ``whitespace``: the pattern allowed between JSON tokens (None:
    the backend's default, "" none). ``field`` names the request field, for errors."""

    kind: Kind
    source: str
    whitespace: str | None = None
    field: str = "structured_outputs"

    @property
    def key(self) -> str:
        """The compiled-automaton cache's key (the field is not part of it)."""
        text = json.dumps([self.kind, self.source, self.whitespace])
        return hashlib.sha256(text.encode()).hexdigest()


@dataclasses.dataclass(frozen=True)
class TokenAutomaton:
    """``table`` [states, V]: next state per (state, token), -1 = not allowed; state 0 starts.
    ``lead``: the tokens it forces from the start (jump-forward: they are fed with the prompt's
    prefill), ending in state ``lead_state``."""

    table: np.ndarray  # [states, V] int32
    key: str
    compile_s: float
    lead: tuple[int, ...] = ()
    lead_state: int = 0

    @property
    def states(self) -> int:
        return self.table.shape[0]

    @property
    def nbytes(self) -> int:
        return self.table.nbytes

    def walk(self, ids: list[int], state: int = 0) -> int:
        """The state after ``ids`` from ``state`` (-1 once a token is not allowed)."""
        for t in ids:
            if state < 0:
                break
            state = int(self.table[state, t])
        return state

    def accepting(self, state: int, eos_id: int) -> bool:
        return state >= 0 and self.table[state, eos_id] == state


HELD = -2  # a grammar-table entry: the row waits for the host's next mask (``HostGrammar``)
MAX_LEAD = 64  # forced tokens at an output's start fed with the prompt (jump-forward), at most


def forced_run(table_SxV: np.ndarray, eos_id: int, state: int = 0) -> tuple[tuple[int, ...], int]:
    """The tokens ``table`` forces from ``state`` (each state on the way allows exactly one token,
    and not EOS), at most ``MAX_LEAD``, and the state after them."""
    out: list[int] = []
    while len(out) < MAX_LEAD:
        allowed = np.flatnonzero(table_SxV[state] >= 0)
        if len(allowed) != 1 or allowed[0] == eos_id:
            break
        out.append(int(allowed[0]))
        state = int(table_SxV[state, allowed[0]])
    return tuple(out), state


@dataclasses.dataclass(frozen=True)
class HostGrammar:
    """A constraint whose masks the host computes per token: ``grammar`` (llguidance's serialized
    grammar) for a matcher per request. On device it holds ``states`` = 2 rows per request, in
    turn the current mask (allowed tokens lead to the other row) and the waiting row (all
    ``HELD``); ``table`` is the first step's pair (``lead_table`` after the forced start), copied
    into each request's own rows."""

    grammar: str
    table: np.ndarray  # [2, V] int32, entries relative to the pair's first row
    key: str
    compile_s: float
    backend: LLGuidance = dataclasses.field(compare=False, repr=False)
    start: Any = dataclasses.field(compare=False, repr=False)  # a matcher at the start, copied per request
    lead: tuple[int, ...] = ()  # the tokens the grammar forces from the start (jump-forward)
    lead_table: np.ndarray | None = None  # the first pair after ``lead``
    states = 2

    @property
    def nbytes(self) -> int:
        return self.table.nbytes + len(self.grammar)

    def matcher(self, lead: bool = False):
        """A new matcher at the grammar's start, or after ``lead`` (one per request; a copy, so the
        scheduler's thread never builds a grammar: that is the compile's work)."""
        m = self.start.deep_copy()
        if lead:
            m.consume_tokens(list(self.lead))
        return m

    def allowed(self, matcher) -> np.ndarray:
        return self.backend.allowed(matcher)


def at_rows(table_SxV: np.ndarray, base: int) -> np.ndarray:
    """A table whose states are numbered from 0 with its states renumbered to grammar-table rows
    from ``base`` (negative entries, -1 and ``HELD``, kept)."""
    return np.where(table_SxV >= 0, table_SxV + base, table_SxV)


def mask_rows(allowed_V: np.ndarray, current: int) -> np.ndarray:
    """The pair of table rows for one host step (entries relative to the pair's first row):
    row ``current`` allows ``allowed`` (leading to the other row), the other row waits."""
    pair = np.full((2, len(allowed_V)), HELD, np.int32)
    pair[current] = np.where(allowed_V, 1 - current, -1)
    return pair


class LLGuidance:
    """llguidance: Lark grammars and JSON schemas to a parser that gives each step's allowed tokens."""

    name = "llguidance"

    def __init__(self, token_bytes: list[bytes | None], eos_id: int, vocab_size: int):
        self.token_bytes, self.eos_id, self.vocab_size = token_bytes, eos_id, vocab_size
        self._tok = None

    def tokenizer(self):
        if self._tok is None:
            import llguidance

            self._tok = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Vocab(self.token_bytes, self.eos_id)))
        return self._tok

    def grammar(self, c: Constraint) -> str:
        """The serialized grammar for ``c``; raises ``InvalidParamError`` with the parser's message."""
        from llguidance import LLMatcher

        if c.kind == "grammar":
            grammar = LLMatcher.grammar_from_lark(c.source)
        else:  # the whitespace between JSON tokens as the automaton backend allows it
            from outlines_core.json_schema import WHITESPACE

            ws = WHITESPACE if c.whitespace is None else c.whitespace
            options = {"whitespace_flexible": bool(ws), "whitespace_pattern": ws or None}
            grammar = LLMatcher.grammar_from_json_schema(closed(json.loads(c.source)), overrides=options)
        failed, messages = LLMatcher.validate_grammar_with_warnings(grammar, self.tokenizer())
        if failed or messages:  # a warning names a keyword it would ignore: refused, not silently dropped
            raise InvalidParamError(
                c.field,
                f"{c.field}: {self.name} cannot enforce it: {'; '.join(messages)}; remove what it names and check "
                "that on the result",
            )
        return grammar

    def matcher(self, grammar: str):
        from llguidance import LLMatcher

        return LLMatcher(self.tokenizer(), grammar, log_level=0)

    def allowed(self, matcher) -> np.ndarray:
        """[V] bool: the tokens ``matcher`` allows next (EOS only where the grammar accepts)."""
        bits = np.unpackbits(np.frombuffer(matcher.compute_bitmask(), np.uint8), bitorder="little")
        out = np.zeros((self.vocab_size,), bool)
        n = min(self.vocab_size, len(self.token_bytes), len(bits))
        out[:n] = bits[:n]
        return out


class _Vocab:
    """What ``llguidance.TokenizerWrapper`` reads: each id's bytes (special ids empty) and an
    encoder (greedy over the bytes: llguidance encodes only the grammar's forced text with it)."""

    bos_token_id = None

    def __init__(self, token_bytes: list[bytes | None], eos_id: int):
        self.eos_token_id = eos_id
        self.tokens = [b or b"" for b in token_bytes]
        self.special_token_ids = [i for i, b in enumerate(token_bytes) if not b]
        self._by_bytes = {b: i for i, b in enumerate(token_bytes) if b}
        self._longest = max(map(len, self._by_bytes), default=1)

    def __call__(self, text: bytes) -> list[int]:
        out, at = [], 0
        while at < len(text):
            for n in range(min(self._longest, len(text) - at), 0, -1):  # the longest token that matches here
                i = self._by_bytes.get(text[at : at + n])
                if i is not None:
                    out.append(i)
                    break
            at += n  # a byte no token holds is skipped (n = 1)
        return out


class Backend(Protocol):
    name: str

    def regex(self, c: Constraint) -> str: ...

    def transitions(self, regex: str) -> tuple[int, dict[int, dict[int, int]], set[int]]:
        """(start, {state: {token: next}}, accepting states) over the served vocabulary."""
        ...


class OutlinesCore:
    """outlines-core: JSON schemas to regexes, regexes to a DFA over token bytes (``Index``)."""

    name = "outlines-core"

    def __init__(self, token_bytes: list[bytes | None], eos_id: int):
        self.token_bytes, self.eos_id = token_bytes, eos_id
        self._vocab = None

    def vocabulary(self):
        if self._vocab is None:
            from outlines_core import Vocabulary

            by_bytes: dict[bytes, list[int]] = collections.defaultdict(list)
            for i, b in enumerate(self.token_bytes):
                if b and i != self.eos_id:
                    by_bytes[b].append(i)
            self._vocab = Vocabulary(self.eos_id, dict(by_bytes))
        return self._vocab

    def regex(self, c: Constraint) -> str:
        from outlines_core.json_schema import build_regex_from_schema

        if c.kind == "regex":
            return c.source
        if c.kind == "choice":
            return "|".join(f"({re.escape(s)})" for s in json.loads(c.source))
        if c.kind == "json_object":
            return json_object_regex(c.whitespace)
        return build_regex_from_schema(c.source, c.whitespace)

    def transitions(self, regex: str) -> tuple[int, dict[int, dict[int, int]], set[int]]:
        from outlines_core import Index

        index = Index(regex, self.vocabulary())
        return index.get_initial_state(), index.get_transitions(), set(index.get_final_states())


def json_object_regex(whitespace: str | None) -> str:
    """Any JSON object two levels deep: its values are scalars, or arrays or objects of scalars
    (401 automaton states over bytes; arbitrary nesting is not a regular language)."""
    from outlines_core.json_schema import BOOLEAN, NULL, NUMBER, STRING, WHITESPACE

    w = WHITESPACE if whitespace is None else whitespace
    scalar = f"({STRING}|{NUMBER}|{BOOLEAN}|{NULL})"

    def obj(value: str) -> str:
        return rf"\{{{w}({STRING}{w}:{w}{value}({w},{w}{STRING}{w}:{w}{value})*)?{w}\}}"

    array = rf"\[{w}({scalar}({w},{w}{scalar})*)?{w}\]"
    return obj(f"({scalar}|{obj(scalar)}|{array})")


def unenforced_keywords(schema: Any, path: str = "$") -> list[str]:
    """Paths of the schema keywords in ``UNENFORCED`` (property names are not keywords)."""
    found = []
    if isinstance(schema, dict):
        for k, v in schema.items():
            if k in ("properties", "$defs", "definitions") and isinstance(v, dict):
                found += [p for name, sub in v.items() for p in unenforced_keywords(sub, f"{path}.{k}.{name}")]
            elif k in UNENFORCED:
                found.append(f"{path}.{k}")
            else:
                found += unenforced_keywords(v, f"{path}.{k}")
    elif isinstance(schema, list):
        found += [p for i, sub in enumerate(schema) for p in unenforced_keywords(sub, f"{path}[{i}]")]
    return found


def closed(schema: Any) -> Any:
    """``schema`` with ``additionalProperties: false`` wherever an object lists its properties and
    says nothing of others (what the automaton backend generates: only a schema's own properties)."""
    if isinstance(schema, list):
        return [closed(x) for x in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: closed(v) if k not in ("properties", "$defs", "definitions") else v for k, v in schema.items()}
    for k in ("properties", "$defs", "definitions"):
        if isinstance(schema.get(k), dict):
            out[k] = {name: closed(sub) for name, sub in schema[k].items()}
    if "properties" in schema and "additionalProperties" not in schema:
        out["additionalProperties"] = False
    return out


def dense(start: int, moves: dict[int, dict[int, int]], finals: set[int], vocab_size: int, eos_id: int) -> np.ndarray:
    """The [states, V] next-state table: states renumbered from ``start`` (0) in order of
    discovery, dead states (no accepting state reachable) removed, EOS a self-loop where accepting."""
    back: dict[int, set[int]] = collections.defaultdict(set)
    for s, out in moves.items():
        for n in out.values():
            back[n].add(s)
    live, todo = set(finals), list(finals)
    while todo:
        for p in back[todo.pop()]:
            if p not in live:
                live.add(p)
                todo.append(p)
    order, seen = [], {start}
    todo = [start] if start in live else []
    while todo:
        s = todo.pop(0)
        order.append(s)
        for n in moves.get(s, {}).values():
            if n in live and n not in seen:
                seen.add(n)
                todo.append(n)
    index = {s: i for i, s in enumerate(order)}
    table = np.full((len(order), vocab_size), -1, np.int32)
    for s, i in index.items():
        for t, n in moves.get(s, {}).items():
            if n in index and t != eos_id:
                table[i, t] = index[n]
        if s in finals:
            table[i, eos_id] = i
    return table


class Compiler:
    """Constraints to ``TokenAutomaton``s (or, past their reach, ``HostGrammar``s with ``host``) for
    one vocabulary, cached by key within ``cache_bytes``; an automaton over ``max_states`` states
    is refused (the device pool's bound per request)."""

    def __init__(
        self,
        backend: Backend,
        vocab_size: int,
        eos_id: int,
        max_states: int,
        host: LLGuidance | None = None,
        cache_bytes: int = 256 << 20,
    ):
        self.backend, self.host, self.vocab_size, self.eos_id = backend, host, vocab_size, eos_id
        self.max_states, self.cache_bytes = max_states, cache_bytes
        self._cache: collections.OrderedDict[str, TokenAutomaton | HostGrammar] = collections.OrderedDict()
        self._lock = threading.Lock()

    def cached(self, c: Constraint) -> TokenAutomaton | HostGrammar | None:
        with self._lock:
            a = self._cache.get(c.key)
            if a is not None:
                self._cache.move_to_end(c.key)
            return a

    def compile(self, c: Constraint) -> TokenAutomaton | HostGrammar:
        """The automaton (or host grammar) for ``c``, cached; raises ``InvalidParamError`` naming
        ``c.field`` for an invalid or unenforceable constraint, or an automaton over ``max_states``."""
        hit = self.cached(c)
        if hit is not None:
            return hit
        t0 = time.perf_counter()
        if len(c.source) > MAX_SOURCE_CHARS:
            raise InvalidParamError(c.field, f"{c.field} is {len(c.source)} characters; at most {MAX_SOURCE_CHARS}")
        if c.kind == "regex":
            try:
                re.compile(c.source)
            except re.error as e:
                raise InvalidParamError(c.field, f"{c.field}: not a valid regular expression: {e}") from None
        if c.kind == "grammar" or (c.kind == "json" and unenforced_keywords(json.loads(c.source))):
            a = self._host(c, t0)
        else:
            a = self._automaton(c, t0)
        with self._lock:
            self._cache[c.key] = a
            while sum(x.nbytes for x in self._cache.values()) > self.cache_bytes and len(self._cache) > 1:
                self._cache.popitem(last=False)
        return a

    def _automaton(self, c: Constraint, t0: float) -> TokenAutomaton:
        try:
            start, moves, finals = self.backend.transitions(self.backend.regex(c))
        except (ValueError, TypeError, re.error) as e:
            raise InvalidParamError(c.field, f"{c.field}: {self.backend.name} could not compile it: {e}") from None
        if len(moves) > self.max_states:
            raise InvalidParamError(c.field, self._too_big(c, len(moves)))
        table = dense(start, moves, finals, self.vocab_size, self.eos_id)
        if table.shape[0] == 0:
            raise InvalidParamError(c.field, f"{c.field}: no output in this vocabulary can match it")
        lead, lead_state = forced_run(table, self.eos_id)
        return TokenAutomaton(table, c.key, time.perf_counter() - t0, lead, lead_state)

    def _host(self, c: Constraint, t0: float) -> HostGrammar:
        if self.host is None:
            raise InvalidParamError(c.field, f"{c.field}: this server has no host grammar backend")
        try:
            grammar = self.host.grammar(c)
        except InvalidParamError as e:
            if c.kind != "json":
                raise
            where = ", ".join(unenforced_keywords(json.loads(c.source)))
            raise InvalidParamError(c.field, f"{e} (keywords past the on-device automaton: {where})") from None
        start = self.host.matcher(grammar)
        first = self.host.allowed(start)
        if not first.any():
            raise InvalidParamError(c.field, f"{c.field}: no output in this vocabulary can match it")
        lead, lead_table = tuple(start.compute_ff_tokens()[:MAX_LEAD]), None
        if lead:
            after = start.deep_copy()
            allowed = self.host.allowed(after) if after.consume_tokens(list(lead)) else None
            lead, lead_table = (lead, mask_rows(allowed, 0)) if allowed is not None and allowed.any() else ((), None)
        pair = mask_rows(first, 0)
        return HostGrammar(grammar, pair, c.key, time.perf_counter() - t0, self.host, start, lead, lead_table)

    def _too_big(self, c: Constraint, states: int) -> str:
        mib = states * self.vocab_size * 4 / 2**20
        return (
            f"{c.field}: its token automaton has {states} states ({mib:.1f} MiB on device); this server allows "
            f"{self.max_states} per request (--structured-states): simplify the schema (fewer optional fields, "
            f"bounded strings) or raise the limit"
        )
