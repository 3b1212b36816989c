"""No request can take the server down: range checks, fault isolation, restarts, disconnects,
compiles seen by JAX itself, auth, body caps, sampling options over HTTP, and a fuzz test."""

import json
import threading
import time

import httpx
import jax
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from serving_helpers import TOK, Running, reference_greedy

from laplace_jax.data.tokenizer import ByteTokenizer
from laplace_jax.serve.metrics import sample_sum

PROMPT = "Return the number of items"

# Every backend compile in this process, as (thread name, function): JAX's own event, not ours.
COMPILES: list[tuple[str, str]] = []
jax.monitoring.register_event_duration_secs_listener(
    lambda event, _s, **kw: (
        COMPILES.append((threading.current_thread().name, kw.get("fun_name", "?")))
        if event == "/jax/core/compile/backend_compile_duration"
        else None
    )
)


def complete(srv, **fields):
    r = srv.post({"model": "tiny", "prompt": PROMPT, "max_tokens": 24, **fields})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def assert_healthy(srv):
    assert httpx.get(srv.url + "/health").status_code == 200
    assert complete(srv, temperature=0)["text"] == TOK.decode(reference_greedy(TOK.encode(PROMPT), 24))


def metric(srv, name: str, **labels: str) -> float:
    return sample_sum(httpx.get(srv.url + "/metrics").text, name, **labels)


def sse(r) -> list[dict]:
    return [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]


# ----- 1. every field range-checked at the boundary ------------------------------------------------
@pytest.mark.parametrize(
    "fields,param",
    [
        ({"seed": 18446744073709551619}, "seed"),
        ({"seed": -1}, "seed"),
        ({"stop_token_ids": [1099511627776]}, "stop_token_ids"),
        ({"stop_token_ids": [256]}, "stop_token_ids"),
        ({"stop_token_ids": list(range(1, 17))}, "stop_token_ids"),
        ({"top_k": -2}, "top_k"),
        ({"top_k": 257}, "top_k"),
        ({"top_p": 0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": 2.01}, "temperature"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 10**30}, "max_tokens"),
        ({"stop": [""]}, "stop"),
        ({"stop": ["a"] * 9}, "stop"),
        ({"stop": "x" * 300}, "stop"),
        ({"prompt": [300]}, "prompt"),
        ({"prompt": [-1]}, "prompt"),
        ({"prompt": "x" * 600}, "prompt"),
        ({"max_tokens": 512}, "max_tokens"),  # 1 prompt token + 512 > max_model_len 512
        ({"n": 10**40}, "n"),
    ],
)
def test_out_of_range_fields_get_400_naming_them(srv, fields, param):
    r = srv.post({"model": "tiny", "prompt": "x", **fields})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error" and err["message"]
    assert httpx.get(srv.url + "/health").status_code == 200


def test_chat_fields_are_checked_too(srv):
    r = srv.post(
        {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "seed": 2**64}, "/v1/chat/completions"
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "seed"


def test_edge_values_are_accepted(srv):
    assert complete(srv, seed=2**63 - 1, temperature=2.0, top_k=256, top_p=1.0, max_tokens=2)["finish_reason"]
    assert complete(srv, top_k=-1, max_tokens=2)["finish_reason"]  # vLLM's "off"


def test_body_size_is_capped_with_413(srv):
    big = {"model": "tiny", "prompt": "a", "user": "u" * (1 << 20)}
    r = srv.post(big)
    assert r.status_code == 413 and r.json()["error"]["code"] == 413

    def chunks():  # no Content-Length: the cap applies while reading
        for _ in range(40):
            yield b" " * 65536

    r = srv.post(content=chunks(), headers={"content-type": "application/json"})
    assert r.status_code == 413
    assert_healthy(srv)


# ----- 2. fault isolation ---------------------------------------------------------------------------
POISON = 7  # a prompt containing this byte makes the prefill fail in the test below


def test_a_failing_prefill_ends_only_that_request(srv):
    eng = srv.engine
    real = eng.programs.executables[("prefill", 1)]

    class Poisoned:
        def __call__(self, params, chunk, *rest):
            if (np.asarray(chunk) == POISON).any():
                raise RuntimeError("injected prefill failure")
            return real(params, chunk, *rest)

    eng.programs.executables[("prefill", 1)] = Poisoned()
    try:
        results = {}

        def good(i):
            r = srv.post({"model": "tiny", "prompt": f"req {i}", "max_tokens": 40, "temperature": 0, "stream": True})
            results[i] = "".join(c["choices"][0]["text"] for c in sse(r))

        threads = [threading.Thread(target=good, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        bad = srv.post({"model": "tiny", "prompt": [65, POISON, 66], "max_tokens": 8})
        for t in threads:
            t.join(120)
    finally:
        eng.programs.executables[("prefill", 1)] = real
    assert bad.status_code == 500 and bad.json()["error"]["type"] == "server_error"
    assert "injected prefill failure" in bad.json()["error"]["message"]
    for i in range(3):
        assert results[i] == TOK.decode(reference_greedy(TOK.encode(f"req {i}"), 40)), i
    assert eng.restarts == 0
    assert_healthy(srv)


def test_a_throwing_client_callback_does_not_stop_the_engine():
    from serving_helpers import CFG, PARAMS, serve_config

    from laplace_jax.serve.engine import Engine
    from laplace_jax.serve.request import Request, SamplingParams

    eng = Engine(CFG, PARAMS, serve_config(max_num_seqs=2, prefill_chunk=16), eos_id=0)
    eng.warmup()
    outs = {0: [], 1: []}

    def boom(tokens, reason):
        raise OSError("client socket closed")

    eng.submit(Request(TOK.encode("a"), SamplingParams(max_tokens=8, ignore_eos=True, temperature=0), boom))
    for i in outs:
        ids = TOK.encode(f"q{i}")
        eng.submit(Request(ids, SamplingParams(max_tokens=8, temperature=0), lambda t, r, i=i: outs[i].extend(t)))
    eng.run_until_idle()
    for i in outs:
        assert outs[i] == reference_greedy(TOK.encode(f"q{i}"), 8)


def test_device_loop_failure_restarts_the_engine():
    s = Running(max_num_seqs=2, prefill_chunk=16, steps_per_call=2, decode_buckets="2")
    try:
        eng = s.engine
        real = eng.programs.executables[("decode", 2)]
        calls = []

        def failing(*args):  # the third decode call fails, after some tokens were streamed
            calls.append(1)
            if len(calls) == 3:
                raise RuntimeError("injected device failure")
            return real(*args)

        eng.programs.executables[("decode", 2)] = failing
        seen = []
        stop_poll = threading.Event()

        def poll():
            while not stop_poll.is_set():
                r = httpx.get(s.url + "/health")
                seen.append((r.status_code, r.text))
                time.sleep(0.02)

        poller = threading.Thread(target=poll)
        poller.start()
        body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 50, "stream": True, "temperature": 0}
        with httpx.stream("POST", s.url + "/v1/completions", json=body, timeout=120) as r:
            events = [line for line in r.iter_lines() if line]
        deadline = time.time() + 120
        while time.time() < deadline and httpx.get(s.url + "/health").status_code != 200:
            time.sleep(0.1)
        stop_poll.set()
        poller.join()
        # the in-flight stream sent text, then an error event, then [DONE]
        assert json.loads(events[0][6:])["choices"][0]["text"]
        assert events[-1] == "data: [DONE]"
        err = json.loads(events[-2][6:])["error"]
        assert err["type"] == "server_error" and "injected device failure" in err["message"]
        # /health said 503 "restarting" with the reason, then recovered
        assert any(code == 503 and "restarting" in text and "injected" in text for code, text in seen)
        assert eng.restarts == 1 and eng.programs.executables[("decode", 2)] is not real  # rebuilt, not the patched one
        assert metric(s, "laplace:engine_restarts_total") == 1
        assert_healthy(s)
    finally:
        s.close()


# ----- 3. disconnects ---------------------------------------------------------------------------------
LONG = {"model": "tiny", "prompt": "abc", "max_tokens": 90_000, "ignore_eos": True, "temperature": 0}


@pytest.fixture(scope="module")
def long_srv():
    """One token per decode call and a 100k-token limit: a request here runs for minutes unless freed."""
    s = Running(max_num_seqs=2, prefill_chunk=16, steps_per_call=1, decode_buckets="2", max_model_len=100_000)
    yield s
    s.close()


def wait_idle(srv, seconds: float) -> float:
    t0 = time.time()
    while time.time() - t0 < seconds and srv.engine.counts() != (0, 0):
        time.sleep(0.01)
    return time.time() - t0


def test_non_streaming_client_timeout_frees_the_slot(long_srv):
    with pytest.raises(httpx.ReadTimeout):
        long_srv.post(LONG, timeout=0.5)
    assert wait_idle(long_srv, 5) < 2.0 and long_srv.engine.counts() == (0, 0)
    assert metric(long_srv, "laplace:num_requests_running") == 0


def test_streaming_client_disconnect_frees_the_slot(long_srv):
    with httpx.stream("POST", long_srv.url + "/v1/completions", json={**LONG, "stream": True}, timeout=60) as r:
        for _ in zip(range(3), r.iter_lines(), strict=False):
            pass
    assert wait_idle(long_srv, 5) < 2.0 and long_srv.engine.counts() == (0, 0)


# ----- 4. compiles after warmup, from JAX's own events ---------------------------------------------
def test_no_compile_after_warmup_from_jax_events(srv):
    COMPILES.clear()
    bodies = [
        {"prompt": "a", "max_tokens": 5, "seed": 3, "temperature": 0.8},
        {"prompt": "long " * 30, "max_tokens": 20, "top_k": 5, "stop_token_ids": [10, 20]},
        {"prompt": [1, 2, 3], "max_tokens": 9, "top_p": 0.5, "stop": ["zz"], "echo": True},
    ]
    threads = [threading.Thread(target=srv.post, args=({"model": "tiny", **b},)) for b in bodies * 3]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    serving_threads = [c for c in COMPILES if c[0] != threading.main_thread().name]
    assert serving_threads == []
    assert srv.engine.compiles.total("serving") == 0
    assert srv.engine.compiles.total("warmup") >= 3 + len(srv.engine.buckets)


def test_the_counter_sees_real_compiles():
    """With exact widths every new width compiles while serving: JAX's events and the counter agree."""
    s = Running(max_num_seqs=3, prefill_chunk=16, steps_per_call=2, decode_buckets="exact")
    try:
        COMPILES.clear()
        threads = [threading.Thread(target=s.post, args=({"model": "tiny", "prompt": "ab", "max_tokens": 30},))]
        threads += [threading.Thread(target=s.post, args=({"model": "tiny", "prompt": "c", "max_tokens": 30},))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        engine_events = [c for c in COMPILES if c[0] == "engine"]
        assert len(engine_events) >= 1
        assert s.engine.compiles.total("serving") == len(engine_events)
        assert metric(s, "laplace:compiles_total", phase="serving") == len(engine_events)
    finally:
        s.close()


# ----- 7. authentication ----------------------------------------------------------------------------
def test_api_key_guards_v1_and_optionally_metrics():
    s = Running(max_num_seqs=1, prefill_chunk=16, decode_buckets="1", api_key="s3cret", protect_metrics=True)
    try:
        body = {"model": "tiny", "prompt": "a", "max_tokens": 2}
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
            r = s.post(body, headers=headers)
            assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        assert httpx.get(s.url + "/v1/models").status_code == 401
        assert s.post(body, headers={"Authorization": "Bearer s3cret"}).status_code == 200
        assert httpx.get(s.url + "/health").status_code == 200
        assert httpx.get(s.url + "/metrics").status_code == 401
        assert httpx.get(s.url + "/metrics", headers={"Authorization": "Bearer s3cret"}).status_code == 200
        import openai

        c = openai.OpenAI(base_url=s.url + "/v1", api_key="s3cret", max_retries=0)
        assert c.completions.create(model="tiny", prompt="a", max_tokens=2).choices[0].finish_reason
    finally:
        s.close()


# ----- 8. sampling options over HTTP ---------------------------------------------------------------
def test_seeded_sampling_is_reproducible_and_seed_dependent(srv):
    a = complete(srv, temperature=1.0, seed=11, max_tokens=32, ignore_eos=True)["text"]
    b = complete(srv, temperature=1.0, seed=11, max_tokens=32, ignore_eos=True)["text"]
    c = complete(srv, temperature=1.0, seed=12, max_tokens=32, ignore_eos=True)["text"]
    assert a == b and a != c


def test_top_k_1_and_tiny_top_p_are_greedy(srv):
    want = TOK.decode(reference_greedy(TOK.encode(PROMPT), 24))
    assert complete(srv, temperature=1.5, top_k=1, seed=1)["text"] == want
    assert complete(srv, temperature=1.5, top_p=1e-6, seed=2)["text"] == want


def test_stop_string_cuts_the_text(srv):
    full = TOK.decode(reference_greedy(TOK.encode(PROMPT), 24))
    stop = full[4:6]
    choice = complete(srv, temperature=0, stop=[stop, "never-there"])
    assert choice["text"] == full[: full.index(stop)] and choice["finish_reason"] == "stop"


def test_stop_token_ids_end_before_the_token(srv):
    ids = reference_greedy(TOK.encode(PROMPT), 24)
    choice = complete(srv, temperature=0, stop_token_ids=[ids[5]])
    assert choice["text"] == TOK.decode(ids[: ids.index(ids[5])]) and choice["finish_reason"] == "stop"


def test_echo_prefixes_the_prompt(srv):
    choice = complete(srv, temperature=0, echo=True, max_tokens=4)
    assert choice["text"] == PROMPT + TOK.decode(reference_greedy(TOK.encode(PROMPT), 4))


def test_ignore_eos_generates_past_eos(srv):
    ids = TOK.encode(PROMPT)
    stops_early = reference_greedy(ids, 60)
    assert len(stops_early) < 60  # this prompt's greedy output hits EOS (id 0)
    choice = complete(srv, temperature=0, max_tokens=60)
    assert choice["finish_reason"] == "stop" and choice["text"] == TOK.decode(stops_early)
    choice = complete(srv, temperature=0, max_tokens=60, ignore_eos=True)
    assert choice["finish_reason"] == "length"
    assert len(choice["text"].encode("utf-8", "replace")) > len(TOK.decode(stops_early).encode("utf-8", "replace"))


def test_chat_stops_at_the_role_marker():
    """The chat template's stop: a tokenizer that renders one generated byte as "<|" must cut there."""
    prompt_ids = TOK.encode("<|user|>\nhi\n<|assistant|>\n")
    out = reference_greedy(prompt_ids, 16)
    k = next(i for i, t in enumerate(out) if i >= 2 and 32 < t < 127)  # an ASCII byte past the start
    trigger = chr(out[k])

    class Marking(ByteTokenizer):
        def decode(self, ids):
            return super().decode(ids).replace(trigger, "<|")

    s = Running(tokenizer=Marking(), max_num_seqs=1, prefill_chunk=16, decode_buckets="1")
    try:
        body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 16, "temperature": 0}
        r = s.post(body, "/v1/chat/completions").json()
        assert r["choices"][0]["finish_reason"] == "stop"
        assert r["choices"][0]["message"]["content"] == Marking().decode(out[:k])
    finally:
        s.close()


# ----- fuzz: random JSON for every field ------------------------------------------------------------
json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=3),
    max_leaves=8,
)
small_ints = st.integers(min_value=-3, max_value=40)
texts = st.text(max_size=30) | st.sampled_from(["\ud800", "a\udfffb", "<|assistant|>", "\0"])
FIELDS = {
    "prompt": texts
    | st.lists(st.integers(-5, 300), max_size=8)
    | st.lists(st.lists(st.integers(-5, 300), max_size=6), max_size=5)
    | st.lists(texts, max_size=5)
    | json_values,
    "max_tokens": small_ints | json_values,
    "temperature": st.floats(-1, 3) | json_values,
    "top_p": st.floats(-0.5, 1.5) | json_values,
    "top_k": small_ints | json_values,
    "min_p": st.floats(-0.5, 1.5) | json_values,
    "seed": st.integers(-(2**65), 2**65) | json_values,
    "stop": st.text(max_size=4) | st.lists(st.text(max_size=4), max_size=10) | json_values,
    "stop_token_ids": st.lists(st.integers(-2, 2**41), max_size=20) | json_values,
    "include_stop_str_in_output": st.booleans() | json_values,
    "stream": st.booleans() | json_values,
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}) | json_values,
    "n": small_ints | st.integers(-(2**70), 2**70) | json_values,
    "best_of": small_ints | json_values,
    "echo": st.booleans() | json_values,
    "ignore_eos": st.booleans() | json_values,
    "logprobs": st.none() | st.booleans() | small_ints | json_values,
    "top_logprobs": small_ints | json_values,
    "prompt_logprobs": small_ints | json_values,
    "min_tokens": small_ints | json_values,
    "presence_penalty": st.floats(-3, 3) | json_values,
    "frequency_penalty": st.floats(-3, 3) | json_values,
    "repetition_penalty": st.floats(-1, 12) | json_values,
    "logit_bias": st.dictionaries(st.integers(-3, 300).map(str) | st.text(max_size=3), st.floats(-200, 200), max_size=4)
    | json_values,
    "suffix": st.none() | st.text(max_size=3) | json_values,
    "response_format": st.fixed_dictionaries({"type": st.sampled_from(["text", "json_object", "x"])}) | json_values,
    "messages": st.lists(
        st.fixed_dictionaries(
            {
                "role": st.sampled_from(["user", "system", "developer", "assistant", "x"]),
                "content": texts
                | st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": texts}), max_size=2),
            }
        ),
        max_size=3,
    )
    | json_values,
    "max_completion_tokens": small_ints | json_values,
    "user": json_values | st.just("tokenize"),
    "bogus": json_values,
}


@st.composite
def bodies(draw):
    chat = draw(st.booleans())
    keys = draw(st.lists(st.sampled_from(sorted(FIELDS)), unique=True, max_size=8))
    body = {"model": draw(st.sampled_from(["tiny", "tiny", "other"]) | json_values)}
    if draw(st.booleans()):
        body["messages" if chat else "prompt"] = draw(FIELDS["messages" if chat else "prompt"])
    for k in keys:
        body[k] = draw(FIELDS[k])
    if draw(st.integers(0, 9)) == 0:
        body = draw(json_values)  # not even an object
    return chat, body


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=bodies())
def test_fuzzed_bodies_never_hurt_the_server(srv, case):
    chat, body = case
    path = "/v1/chat/completions" if chat else "/v1/completions"
    if isinstance(body, dict) and body.get("user") == "tokenize":  # the tokenizer routes take the same bodies
        path = "/tokenize"
    r = srv.post(route=path, content=json.dumps(body, allow_nan=True), timeout=60)
    assert 200 <= r.status_code < 500, (r.status_code, r.text[:300])
    if r.status_code >= 400:
        err = r.json()["error"]
        assert err["code"] == r.status_code and err["message"] and err["type"]
    elif r.headers["content-type"].startswith("text/event-stream"):
        assert r.text.rstrip().endswith("data: [DONE]")
    elif path == "/tokenize":
        assert isinstance(r.json()["tokens"], list)
    else:
        assert r.json()["choices"] and all(c["finish_reason"] in ("stop", "length") for c in r.json()["choices"])
    assert httpx.get(srv.url + "/health").status_code == 200


def test_after_fuzzing_nothing_is_left_running(srv):
    assert wait_idle(srv, 5) < 5 and srv.engine.counts() == (0, 0)
    assert metric(srv, "laplace:num_requests_running") == 0
    assert srv.engine.compiles.total("serving") == 0
    assert_healthy(srv)
