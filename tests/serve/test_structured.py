"""Structured outputs: token automata against Python's own regex engine, the grammar mask against
a NumPy reference, the grammar-table pool, and the request contract through the openai client
(outputs validated with jsonschema)."""

import json
import re

import jax
import jax.numpy as jnp
import jsonschema
import numpy as np
import pytest
from serving_helpers import CFG, PARAMS, TOK, reference_greedy, serve_config

from laplace_jax.data.tokenizer import load_tokenizer
from laplace_jax.errors import InvalidParamError
from laplace_jax.sampling import grammar_limit, grammar_next, grammar_tiles
from laplace_jax.serve.engine import Engine
from laplace_jax.serve.grammar_pool import GrammarPool
from laplace_jax.serve.request import Request, SamplingParams
from laplace_jax.serve.structured import (
    HELD,
    Compiler,
    Constraint,
    HostGrammar,
    LLGuidance,
    OutlinesCore,
    TokenAutomaton,
)

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "ok": {"type": "boolean"},
        "kind": {"enum": ["cat", "dog"]},
        "tags": {"type": "array", "items": {"enum": ["x", "y"]}, "maxItems": 2},
    },
    "required": ["name", "ok", "kind"],
}
REGEX = r"(cat|dog)s? [0-9]{2,4}!"
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"enum": ["Paris", "Rome"]}, "metric": {"type": "boolean"}},
                "required": ["city", "metric"],
            },
        },
    },
    {"type": "function", "function": {"name": "noop"}},
]


CHOICES = ["positive", "negative", "neutral"]
LARK = 'start: "(" num ("," num)* ")"\nnum: /[0-9]{1,3}/'
LARK_AS_REGEX = r"\([0-9]{1,3}(,[0-9]{1,3})*\)"
BOUNDED = {  # keywords past a regular expression: served by host masks
    "type": "object",
    "properties": {
        "n": {"type": "integer", "minimum": 3, "maximum": 7},
        "x": {"type": "number", "exclusiveMinimum": 0},
    },
    "required": ["n", "x"],
}


def byte_compiler(max_states=1024):
    tb = TOK.token_bytes()
    return Compiler(OutlinesCore(tb, TOK.eos_id), 256, TOK.eos_id, max_states, LLGuidance(tb, TOK.eos_id, 256))


def sample_walk(a, rng, eos_id, limit=20_000):
    """A random accepted token sequence of automaton ``a`` (EOS taken once accepting, or by chance)."""
    state, out = 0, []
    for _ in range(limit):
        allowed = np.flatnonzero(a.table[state] >= 0)
        assert len(allowed) > 0, "a live state allows at least one token"
        t = int(rng.choice(allowed))
        if t == eos_id:
            return out
        out.append(t)
        state = int(a.table[state, t])
    pytest.fail("walk did not end")


@pytest.mark.parametrize(
    "kind,source", [("regex", REGEX), ("json", json.dumps(SCHEMA)), ("choice", '["yes","no"]'), ("json_object", "")]
)
def test_byte_automaton_accepts_exactly_the_language(kind, source):
    a = byte_compiler().compile(Constraint(kind, source))
    rng = np.random.default_rng(0)
    for _ in range(200):
        text = bytes(sample_walk(a, rng, TOK.eos_id)).decode("utf-8")
        if kind == "regex":
            assert re.fullmatch(REGEX, text)
        elif kind == "json":
            jsonschema.validate(json.loads(text), SCHEMA)
        elif kind == "json_object":
            assert isinstance(json.loads(text), dict)
        else:
            assert text in ("yes", "no")
    for good in ("cat 12!", "dogs 9999!"):  # strings of the language reach an accepting state
        assert a.accepting(a.walk(list(good.encode())), TOK.eos_id) or kind != "regex"
    if kind == "regex":
        for bad in ("cat 1!", "cow 12!", "cat 12345!"):
            assert not a.accepting(a.walk(list(bad.encode())), TOK.eos_id)


def test_bpe_tokens_bytes_and_automaton(tmp_path):
    """Byte-level BPE: each token's bytes rebuild the text, and multi-byte tokens walk the automaton."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>"], initial_alphabet=alphabet)
    bpe.train_from_iterator(['{"kind": "cat", "ok": true} caf\u00e9 12!'] * 50, trainer)
    bpe.save(str(tmp_path / "tokenizer.json"))
    tok = load_tokenizer(str(tmp_path / "tokenizer.json"))
    tb = tok.token_bytes()
    text = '{"kind": "dog", "ok": false} caf\u00e9 \u00fc 12!'
    assert b"".join(tb[i] for i in tok.encode(text)) == text.encode()
    assert tb[tok.eos_id] is None
    comp = Compiler(OutlinesCore(tb, tok.eos_id), tok.vocab_size, tok.eos_id, 1024)
    a = comp.compile(Constraint("regex", r'\{"kind": "(cat|dog)", "ok": (true|false)\}'))
    ids = tok.encode('{"kind": "cat", "ok": true}')
    assert len(ids) < len('{"kind": "cat", "ok": true}')  # merged tokens, not bytes
    assert a.accepting(a.walk(ids), tok.eos_id)
    rng = np.random.default_rng(1)
    for _ in range(50):
        out = sample_walk(a, rng, tok.eos_id)
        assert re.fullmatch(r'\{"kind": "(cat|dog)", "ok": (true|false)\}', b"".join(tb[i] for i in out).decode())


def test_compile_errors_name_the_field_and_bounds():
    comp = byte_compiler(max_states=20)
    cases = [
        (Constraint("regex", "(", field="structured_outputs.regex"), "not a valid regular expression"),
        (Constraint("json", json.dumps({"type": "array", "uniqueItems": True}), field="f"), "$.uniqueItems"),
        (Constraint("grammar", "start: foo", field="g"), 'unknown name: "foo"'),
        (Constraint("json", json.dumps(SCHEMA), field="f"), "states"),
    ]
    for c, words in cases:
        with pytest.raises(InvalidParamError, match=re.escape(words)) as e:
            comp.compile(c)
        assert e.value.param == c.field
    a = comp.compile(Constraint("choice", '["a"]'))
    assert comp.compile(Constraint("choice", '["a"]')) is a  # cached by hash


def test_grammar_limit_against_numpy():
    rng = np.random.default_rng(0)
    W, V, R = 4, 200, 3  # two tiles of 128, the second padded
    table = rng.integers(-1, R, size=(R, V)).astype(np.int32)
    table[2] = -1
    table[2, 5] = 2  # state 2: only token 5 (EOS-like)
    logits = rng.normal(size=(W, V)).astype(np.float32)
    pen = logits.copy()
    pen[3, 5] = -np.inf  # min_tokens masked the only allowed token of row 3
    g = np.array([-1, 0, 1, 2], np.int32)
    masked = np.asarray(
        grammar_limit(jnp.asarray(pen), jnp.asarray(logits), jnp.asarray(grammar_tiles(table)), jnp.asarray(g))
    )
    np.testing.assert_array_equal(masked[0], pen[0])  # unconstrained: unchanged, bit for bit
    for w in (1, 2):
        np.testing.assert_array_equal(masked[w], np.where(table[g[w]] >= 0, pen[w], -np.inf))
    np.testing.assert_array_equal(masked[3], np.where(table[2] >= 0, logits[3], -np.inf))  # the grammar wins
    tok = jnp.asarray([3, int(np.flatnonzero(table[0] >= 0)[0]), int(np.flatnonzero(table[1] >= 0)[0]), 5])
    after = np.asarray(
        grammar_next(jnp.asarray(grammar_tiles(table)), jnp.asarray(g), tok, jnp.asarray([True, True, False, True]))
    )
    assert after.tolist() == [-1, table[0, int(tok[1])], 1, 2]  # row 2 invalid: keeps its state
    free = np.full((W,), -1, np.int32)  # no row constrained: the table is not read, the logits pass through
    same = grammar_limit(jnp.asarray(pen), jnp.asarray(logits), jnp.asarray(grammar_tiles(table)), jnp.asarray(free))
    np.testing.assert_array_equal(np.asarray(same), pen)


def test_pool_shares_reuses_and_evicts_only_idle_runs():
    comp = byte_compiler()
    a, b = comp.compile(Constraint("regex", REGEX)), comp.compile(Constraint("choice", '["yes","no"]'))
    pool = GrammarPool(a.states + 2)
    r1, r2, r3 = (Request([1], SamplingParams(), lambda *_: None) for _ in range(3))
    assert pool.acquire(a, r1, {r1}) == 0
    [(base, rows)] = pool.writes()
    assert base == 0 and np.array_equal(rows, a.table) and pool.writes() == []
    assert pool.acquire(a, r2, {r1, r2}) == 0 and pool.writes() == []  # shared, no second write
    assert pool.acquire(b, r3, {r1, r2, r3}) is None  # a is live: no room
    assert pool.acquire(b, r3, {r3}) == 0  # a's requests ended: its run is dropped
    assert [w[0] for w in pool.writes()] == [0]
    h = byte_compiler().compile(Constraint("grammar", LARK))
    assert isinstance(h, HostGrammar) and pool.acquire(h, r1, {r1, r3}) == b.states  # after b's run
    [(base, rows)] = pool.writes()  # the pair's states renumbered to table rows, HELD kept
    assert np.array_equal(rows[1], np.full(256, HELD)) and set(rows[0][rows[0] >= 0]) == {base + 1}


def test_engine_masks_on_device_and_leaves_unconstrained_rows_alone():
    eng = Engine(CFG, PARAMS, serve_config(max_num_seqs=4, prefill_chunk=16, steps_per_call=4), eos_id=TOK.eos_id)
    eng.warmup()
    comp = byte_compiler()
    rx, js = comp.compile(Constraint("regex", REGEX)), comp.compile(Constraint("json", json.dumps(SCHEMA)))
    prompts = [list(b"hello "), list(b"abc"), list(b"xyz"), list(b"q"), list(b"hello ")]
    sps = [
        SamplingParams(max_tokens=80, temperature=1.0, seed=1, automaton=rx),
        SamplingParams(max_tokens=120, temperature=1.0, seed=2, automaton=js),
        SamplingParams(max_tokens=12, temperature=0.0),
        SamplingParams(max_tokens=80, temperature=0.0, automaton=js, min_tokens=80),  # the grammar wins
        SamplingParams(max_tokens=12, temperature=0.0),
    ]
    launch = eng.programs.launch

    def on_device_only(width, *steps):  # a decode call sends nothing from the host: the masks live on device
        with jax.transfer_guard_host_to_device("disallow_explicit"):
            return launch(width, *steps)

    eng.programs.launch = on_device_only
    outs = eng.generate(prompts, sps)
    assert eng.compiles.total("serving") == 0  # (before the reference decode below compiles its own)
    assert re.fullmatch(REGEX, bytes(outs[0].tokens).decode()) and outs[0].finish_reason == "stop"
    for o in (outs[1], outs[3]):
        jsonschema.validate(json.loads(bytes(o.tokens).decode()), SCHEMA)
        assert o.finish_reason == "stop"
    assert outs[2].tokens == reference_greedy(prompts[2], 12)
    assert outs[4].tokens == reference_greedy(prompts[4], 12)


def _validate(text, schema):
    jsonschema.validate(json.loads(text), schema)


def test_openai_client_gets_valid_structured_outputs_and_tool_calls(srv):
    """250 requests (50 of each kind: response_format json_schema, structured_outputs regex and
    choice, tool_choice named and required; n=2, half of them streamed): every output parses and
    validates."""
    c = srv.client()
    chat = [{"role": "user", "content": "go"}]
    fmt = {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA, "strict": True}}
    weather = TOOLS[0]["function"]["parameters"]
    checked = 0
    for i in range(50):
        stream = i % 2 == 1
        kw = {"model": "tiny", "n": 2, "max_tokens": 150, "temperature": 1.0, "seed": i, "stream": stream}
        got = _texts(c.chat.completions.create(messages=chat, response_format=fmt, **kw), stream)
        for text, _ in got:
            _validate(text, SCHEMA)
        got = _texts(
            c.completions.create(prompt="x", extra_body={"structured_outputs": {"regex": REGEX}}, **kw), stream
        )
        assert all(re.fullmatch(REGEX, t) for t, _ in got)
        got = _texts(
            c.completions.create(prompt="x", extra_body={"structured_outputs": {"choice": CHOICES}}, **kw), stream
        )
        assert all(t in CHOICES and why == "stop" for t, why in got)
        named = {"type": "function", "function": {"name": "weather"}}
        for call in _calls(c.chat.completions.create(messages=chat, tools=TOOLS, tool_choice=named, **kw), stream):
            assert call["name"] == "weather" and call["id"].startswith("call_")
            _validate(call["arguments"], weather)
        resp = c.chat.completions.create(
            messages=chat, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, **kw
        )
        for call in _calls(resp, stream):
            assert call["name"] in ("weather", "noop")
            _validate(call["arguments"], weather if call["name"] == "weather" else {"type": "object"})
        checked += 5
    assert checked == 250
    assert srv.engine.compiles.total("serving") == 0


def _texts(resp, stream):
    """[(text, finish_reason)] per choice of a completion or chat response, streamed or not."""
    if not stream:
        return [(getattr(ch, "text", None) or ch.message.content, ch.finish_reason) for ch in resp.choices]
    text, finish = {}, {}
    for chunk in resp:
        for ch in chunk.choices:
            piece = ch.text if hasattr(ch, "text") else ch.delta.content
            text[ch.index] = text.get(ch.index, "") + (piece or "")
            finish[ch.index] = ch.finish_reason or finish.get(ch.index)
    assert len(text) == 2 and all(f == "stop" for f in finish.values())
    return [(text[i], finish[i]) for i in sorted(text)]


def _calls(resp, stream):
    """Every tool call of every choice as {id, name, arguments}, rebuilt from deltas when streamed."""
    if not stream:
        assert all(ch.message.content is None and ch.finish_reason in ("stop", "tool_calls") for ch in resp.choices)
        return [
            {"id": t.id, "name": t.function.name, "arguments": t.function.arguments}
            for ch in resp.choices
            for t in ch.message.tool_calls
        ]
    calls = {}
    for chunk in resp:
        for ch in chunk.choices:
            for t in ch.delta.tool_calls or ():
                cur = calls.setdefault((ch.index, t.index), {"id": None, "name": None, "arguments": ""})
                cur["id"] = t.id or cur["id"]
                cur["name"] = t.function.name or cur["name"]
                cur["arguments"] += t.function.arguments or ""
    assert {k[0] for k in calls} == {0, 1}
    return list(calls.values())


@pytest.mark.parametrize(
    "body,words",
    [
        ({"structured_outputs": {"regex": "("}}, "structured_outputs.regex: not a valid regular expression"),
        ({"structured_outputs": {"json": {"type": "array", "uniqueItems": True}}}, "$.uniqueItems"),
        ({"structured_outputs": {"grammar": "start: x"}}, "structured_outputs.grammar: llguidance cannot enforce it"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "exactly one of"),
        ({"structured_outputs": {"json": "{bad"}}, "not valid JSON"),
        ({"guided_json": {}}, "send structured_outputs.json"),
    ],
)
def test_bad_constraints_get_400_naming_the_field(srv, body, words):
    r = srv.post({"model": "tiny", "prompt": "x", **body})
    assert r.status_code == 400 and words in r.json()["error"]["message"]


def test_tool_choice_auto_and_unknown_function_are_refused(srv):
    base = {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "tools": TOOLS}
    r = srv.post({**base, "tool_choice": "auto"}, route="/v1/chat/completions")
    assert r.status_code == 400 and "model-specific tool-call format" in r.json()["error"]["message"]
    named = {"type": "function", "function": {"name": "nope"}}
    r = srv.post({**base, "tool_choice": named}, route="/v1/chat/completions")
    assert r.status_code == 400 and "not in tools" in r.json()["error"]["message"]


def test_host_grammars_mask_per_token_beside_automata_and_plain_rows():
    """A Lark grammar and a schema with numeric bounds (llguidance's masks, written by the host)
    decode in one batch with an automaton row and plain greedy rows: every output is in its
    language, the plain rows equal the reference, and nothing compiles after warmup. While other
    rows decode, a step is one call of one step and one of ``steps_per_call`` whose run the host's
    masks are written in; once only host rows are left, a step is one call of one step; and every
    output is the same token for token as from one call of ``steps_per_call`` per step."""
    eng = Engine(CFG, PARAMS, serve_config(max_num_seqs=4, prefill_chunk=16, steps_per_call=4), eos_id=TOK.eos_id)
    eng.warmup()
    comp = byte_compiler()
    lark, bounded = comp.compile(Constraint("grammar", LARK)), comp.compile(Constraint("json", json.dumps(BOUNDED)))
    rx = comp.compile(Constraint("regex", REGEX))
    assert isinstance(lark, HostGrammar) and isinstance(bounded, HostGrammar) and isinstance(rx, TokenAutomaton)
    prompts = [list(b"a"), list(b"b"), list(b"xyz"), list(b"q"), list(b"hello "), list(b"z")]
    sps = [
        SamplingParams(max_tokens=60, temperature=1.0, seed=1, automaton=lark),
        SamplingParams(max_tokens=80, temperature=1.0, seed=2, automaton=bounded),
        SamplingParams(max_tokens=12, temperature=0.0),
        SamplingParams(max_tokens=60, temperature=1.0, seed=3, automaton=rx),
        SamplingParams(max_tokens=12, temperature=0.0),
        SamplingParams(max_tokens=60, temperature=0.0, automaton=lark, min_tokens=60),  # the grammar wins
    ]
    events = []
    programs = eng.programs
    launch, read, write = programs.launch, programs.read, programs.write_grammar
    programs.launch = lambda width, *steps: (events.append(f"launch{steps}"), launch(width, *steps))[1]
    programs.read = lambda call: (events.append("read"), read(call))[1]
    programs.write_grammar = lambda writes: (writes and events.append("write"), write(writes))[1]
    outs = eng.generate(prompts, sps)
    assert eng.compiles.total("serving") == 0
    trace = " ".join(events)
    assert "launch(1,) launch(4,) read write read" in trace  # the masks written while the second call runs
    assert "launch(1,) read write launch(1,)" in trace  # host rows alone: one step per call
    eng.scheduler.one_step = False
    again = eng.generate(prompts, sps)
    assert [o.tokens for o in again] == [o.tokens for o in outs]
    for o in (outs[0], outs[5]):
        assert re.fullmatch(LARK_AS_REGEX, bytes(o.tokens).decode()) and o.finish_reason == "stop"
    jsonschema.validate(json.loads(bytes(outs[1].tokens).decode()), BOUNDED)
    assert re.fullmatch(REGEX, bytes(outs[3].tokens).decode())
    assert outs[2].tokens == reference_greedy(prompts[2], 12)
    assert outs[4].tokens == reference_greedy(prompts[4], 12)


def test_openai_client_gets_grammar_and_bounded_schema_outputs(srv):
    c = srv.client()
    fmt = {"type": "json_schema", "json_schema": {"name": "bounded", "schema": BOUNDED}}
    for stream in (False, True):
        kw = {"model": "tiny", "n": 2, "max_tokens": 80, "temperature": 1.0, "seed": 5, "stream": stream}
        got = _texts(
            c.completions.create(prompt="x", extra_body={"structured_outputs": {"grammar": LARK}}, **kw), stream
        )
        assert all(re.fullmatch(LARK_AS_REGEX, t) for t, _ in got)
        chat = c.chat.completions.create(messages=[{"role": "user", "content": "go"}], response_format=fmt, **kw)
        for text, _ in _texts(chat, stream):
            _validate(text, BOUNDED)
    assert srv.engine.compiles.total("serving") == 0


def test_constrained_logprobs_are_the_models_own_and_cover_every_token(srv):
    """Logprobs under a grammar (host masks) and an automaton: one entry per generated token, the
    sampled token's logprob among the model's own (raw, unmasked) distribution's."""
    c = srv.client()
    for body in ({"grammar": LARK}, {"regex": REGEX}):
        r = c.completions.create(
            model="tiny", prompt="x", max_tokens=40, temperature=1.0, seed=3, logprobs=2, n=2,
            extra_body={"structured_outputs": body},
        )  # fmt: skip
        for ch in r.choices:
            lp = ch.logprobs
            assert "".join(lp.tokens) == ch.text and len(lp.token_logprobs) == len(lp.tokens) > 0
            assert all(x <= 0 for x in lp.token_logprobs) and all(
                2 <= len(t) <= 3 for t in lp.top_logprobs
            )  # top 2 (+ the sampled)


def masked_greedy(ids, a, n, eos_id=TOK.eos_id):
    """An independent reference: the model's recurrent path over the prompt, then argmax over the
    tokens automaton ``a`` allows (NumPy), until EOS or n tokens."""
    from laplace_jax.models.gla_lm import decode_step, init_state

    step = jax.jit(decode_step, static_argnums=0)
    state, s, out = init_state(CFG, 1), 0, []
    for t in ids:
        logits, state = step(CFG, PARAMS, jnp.asarray([t]), state)
    for _ in range(n):
        t = int(np.argmax(np.where(a.table[s] >= 0, np.asarray(logits[0]), -np.inf)))
        if t == eos_id:
            break
        out.append(t)
        s = int(a.table[s, t])
        logits, state = step(CFG, PARAMS, jnp.asarray([t]), state)
    return out


def test_jump_forward_feeds_the_forced_start_with_the_prompt_and_changes_no_greedy_token():
    comp = byte_compiler()
    answer = comp.compile(Constraint("regex", r"The answer is (yes|no)\. [a-z]{1,9}!"))
    compact = comp.compile(Constraint("json", json.dumps(SCHEMA), ""))  # no whitespace: '{"name":"' is forced
    assert bytes(answer.lead) == b"The answer is " and answer.lead_state == answer.walk(list(answer.lead))
    assert bytes(compact.lead) == b'{"name":"'
    eng = Engine(CFG, PARAMS, serve_config(max_num_seqs=4, prefill_chunk=16, steps_per_call=4), eos_id=TOK.eos_id)
    eng.warmup()
    fed = []
    prefill_rows = eng.programs.prefill_rows

    def spy(prompts, *args):
        fed.extend(prompts.values())
        return prefill_rows(prompts, *args)

    eng.programs.prefill_rows = spy
    prompts = [list(b"Q: "), list(b"{"), list(b"Q: ")]
    sps = [
        SamplingParams(max_tokens=40, temperature=0.0, automaton=answer),
        SamplingParams(max_tokens=60, temperature=0.0, automaton=compact),
        SamplingParams(max_tokens=40, temperature=0.0, automaton=answer, logprobs=1),  # logprobs: no jump
    ]
    outs = eng.generate(prompts, sps)
    assert eng.compiles.total("serving") == 0
    for p, a, o in zip(prompts, (answer, compact, answer), outs, strict=True):
        assert o.tokens == masked_greedy(p, a, 60 if a is compact else 40) and o.finish_reason == "stop"
    assert outs[2].tokens == outs[0].tokens and len(outs[2].logprobs) == len(outs[2].tokens)
    assert sorted(map(tuple, fed)) == sorted(
        [(*prompts[0], *answer.lead), (*prompts[1], *compact.lead), tuple(prompts[2])]
    )  # the forced starts rode the prefill; the request with logprobs decoded them one by one


def test_jump_forward_mid_output_verifies_forced_runs_and_changes_no_greedy_token():
    """With ``jump_forward`` 4 a constrained row drafts the tokens its automaton forces in the
    middle of an output (a JSON key after a value, the '. ' after 'yes') and a verify emits up to
    five per step: greedy outputs equal the masked greedy reference and, with a frequency penalty,
    the one-token-per-step engine's output; sampled rows stay in their language; a host grammar's
    row beside them is unchanged; nothing compiles after warmup, and the speculation counters
    count no forced draft."""
    comp = byte_compiler()
    answer = comp.compile(Constraint("regex", r"The answer is (yes|no)\. [a-z]{1,9}!"))
    compact = comp.compile(Constraint("json", json.dumps(SCHEMA), ""))
    lark = comp.compile(Constraint("grammar", LARK))
    prompts = [list(b"Q: "), list(b"{"), list(b"x"), list(b"{"), list(b"a"), list(b"hello ")]
    sps = [
        SamplingParams(max_tokens=40, temperature=0.0, automaton=answer),
        SamplingParams(max_tokens=60, temperature=0.0, automaton=compact, logprobs=1),  # no lead: forced mid-output
        SamplingParams(max_tokens=60, temperature=1.0, seed=4, automaton=compact),
        SamplingParams(max_tokens=60, temperature=0.0, automaton=compact, frequency_penalty=1.5),
        SamplingParams(max_tokens=40, temperature=1.0, seed=5, automaton=lark),
        SamplingParams(max_tokens=12, temperature=0.0),
    ]
    outs, steps = {}, {}
    for jump in (0, 4):
        eng = Engine(
            CFG, PARAMS, serve_config(max_num_seqs=8, prefill_chunk=16, steps_per_call=4, jump_forward=jump),
            eos_id=TOK.eos_id,
        )  # fmt: skip
        eng.warmup()
        read, per_step = eng.programs.read, []

        def counted(launched, read=read, per_step=per_step, jump=jump):
            toks, valid, lps = read(launched)
            per_step.append(valid.reshape(-1, 1 + jump, *valid.shape[1:]).sum(axis=1).max())
            return toks, valid, lps

        eng.programs.read = counted
        outs[jump] = eng.generate(prompts, sps)
        steps[jump] = per_step
        assert eng.compiles.total("serving") == 0
        assert not eng.programs.speculation_counts.any()
    assert max(steps[0]) == 1 and max(steps[4]) == 5  # some step emitted a whole forced run and one more
    for jump in (0, 4):
        o = outs[jump]
        assert o[0].tokens == masked_greedy(prompts[0], answer, 40)
        assert o[1].tokens == masked_greedy(prompts[1], compact, 60) and len(o[1].logprobs) == len(o[1].tokens)
        for x in (o[2], o[3]):
            jsonschema.validate(json.loads(bytes(x.tokens).decode()), SCHEMA)
        assert re.fullmatch(LARK_AS_REGEX, bytes(o[4].tokens).decode())
        assert o[5].tokens == reference_greedy(prompts[5], 12)
    assert outs[4][3].tokens == outs[0][3].tokens  # the penalized row: counts over every forced token
    assert outs[4][4].tokens == outs[0][4].tokens  # the host grammar's row drafts nothing
    np.testing.assert_allclose(
        [x[0] for x in outs[4][1].logprobs], [x[0] for x in outs[0][1].logprobs], rtol=1e-5
    )  # the verify's logprobs are the plain steps'
