"""The HTTP server on a loopback port: openai client, staggered load, disconnects, 429, errors, warm restart."""

import concurrent.futures
import json
import re
import subprocess
import sys
import threading
import time

import httpx
import jax
import jax.numpy as jnp
import numpy as np
import portpicker
import pytest
from helpers import child_env
from prometheus_client.parser import text_string_to_metric_families
from serving_helpers import CFG, PARAMS, TOK, Running, reference_greedy


def test_completions_stream_and_chat(srv):
    c = srv.client()
    prompt = "Return the number of items"
    ids = reference_greedy(TOK.encode(prompt), 24)
    want = TOK.decode(ids)
    r = c.completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=0)
    assert r.choices[0].text == want
    assert r.usage.prompt_tokens == len(prompt) and r.usage.completion_tokens == len(ids)
    assert r.choices[0].finish_reason == ("length" if len(ids) == 24 else "stop")
    chunks = list(
        c.completions.create(
            model="tiny",
            prompt=prompt,
            max_tokens=24,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == want
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens
    chat = c.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=8, temperature=0
    )
    assert chat.choices[0].message.role == "assistant" and chat.choices[0].finish_reason in ("stop", "length")
    assert [m.id for m in c.models.list().data] == ["tiny"]


def test_continuous_usage_stats_put_the_usage_so_far_in_every_chunk(srv):
    """vLLM's benchmark client streams chat with stream_options {include_usage, continuous_usage_stats}."""
    opts = {"include_usage": True, "continuous_usage_stats": True}
    chunks = list(
        srv.client().chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=8, temperature=0,
            stream=True, stream_options=opts, extra_body={"ignore_eos": True},
        )
    )  # fmt: skip
    counts = [ch.usage.completion_tokens for ch in chunks]
    assert all(ch.usage is not None for ch in chunks)
    assert counts == sorted(counts) and counts[-1] == 8 and chunks[-1].choices == []
    assert len({ch.usage.prompt_tokens for ch in chunks}) == 1


def test_chat_content_and_its_stream_are_the_models_greedy_text(srv):
    """Chat renders "<|user|>\nhi\n<|assistant|>\n", and its content is the model's greedy
    continuation, cut at the first "<|" (a role marker) or EOS; the stream's deltas add up to it."""
    c = srv.client()
    messages = [{"role": "user", "content": "hi"}]
    chat = c.chat.completions.create(model="tiny", messages=messages, max_tokens=24, temperature=0)
    want = TOK.decode(reference_greedy(TOK.encode("<|user|>\nhi\n<|assistant|>\n"), 24)).split("<|")[0]
    assert chat.choices[0].message.content == want
    chunks = list(c.chat.completions.create(model="tiny", messages=messages, max_tokens=24, temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == want
    assert chunks[-1].choices[0].finish_reason == chat.choices[0].finish_reason
    assert {ch.id for ch in chunks} == {chunks[0].id} and all(ch.object == "chat.completion.chunk" for ch in chunks)


@pytest.mark.parametrize(
    "spec, want", [("pow2", [1, 2, 4, 6]), ("exact", None), ("1,4", [1, 4, 6]), ("2,6", [2, 6]), ("1,4,6", [1, 4, 6])]
)
def test_decode_bucket_specs(spec, want):
    from laplace_jax.serve.scheduler import make_buckets

    assert make_buckets(spec if spec in ("pow2", "exact") else spec.split(","), 6) == want


@pytest.mark.parametrize("spec", ["0,4", "4,9", "a,b", ""])
def test_bad_decode_bucket_specs_are_refused_clearly(spec):
    from laplace_jax.serve.scheduler import make_buckets

    with pytest.raises(ValueError, match="decode buckets"):
        make_buckets(spec.split(","), 6)


def test_forty_staggered_requests(srv):
    rng = np.random.default_rng(0)
    jobs = []
    for _ in range(40):
        ids = rng.integers(1, 256, int(rng.integers(1, 60))).tolist()
        jobs.append((ids, int(rng.integers(1, 30))))
    results = [None] * 40

    def go(i):
        ids, n = jobs[i]
        r = srv.post({"model": "tiny", "prompt": ids, "max_tokens": n, "temperature": 0}, timeout=300)
        results[i] = r.json()

    threads = []
    for i in range(40):
        threads.append(threading.Thread(target=go, args=(i,)))
        threads[-1].start()
        time.sleep(float(rng.exponential(0.03)))
    for t in threads:
        t.join(300)
    for i, (ids, n) in enumerate(jobs):
        assert results[i]["choices"][0]["text"] == TOK.decode(reference_greedy(ids, n)), i
    assert srv.engine.compiles.total("serving") == 0
    used = {
        int(s.labels["bucket"])
        for family in text_string_to_metric_families(httpx.get(srv.url + "/metrics").text)
        for s in family.samples
        if s.name == "laplace:decode_steps_total"
    }
    assert used <= set(srv.engine.buckets)


def test_disconnect_frees_slot(srv):
    with httpx.stream(
        "POST",
        srv.url + "/v1/completions",
        timeout=60,
        json={
            "model": "tiny",
            "prompt": "abc",
            "max_tokens": 400,
            "stream": True,
            "ignore_eos": True,
            "temperature": 0,
        },
    ) as r:
        for _ in zip(range(3), r.iter_lines(), strict=False):
            pass
    deadline = time.time() + 10
    while time.time() < deadline and srv.engine.counts()[0]:
        time.sleep(0.05)
    assert srv.engine.counts() == (0, 0)
    assert "laplace:num_requests_running 0.0" in httpx.get(srv.url + "/metrics").text


@pytest.mark.parametrize(
    "body,status,param",
    [
        ({"model": "tiny", "prompt": "x", "bogus": 1}, 400, "bogus"),
        ({"model": "tiny", "prompt": "x", "max_tokens": -1}, 400, "max_tokens"),
        ({"model": "nope", "prompt": "x"}, 404, "model"),
        ({"model": "tiny", "prompt": "x" * 600, "max_tokens": 4}, 400, "prompt"),
        ({"model": "tiny", "prompt": "x", "n": 5}, 400, "n"),  # more than the 4 slots of a device
        ({"model": "tiny", "prompt": "x", "n": 2, "best_of": 1}, 400, "n"),
        ({"model": "tiny", "prompt": "x", "suffix": "y"}, 400, "suffix"),
        ({"model": "tiny", "prompt": "x", "presence_penalty": 2.5}, 400, "presence_penalty"),
        ({"model": "tiny", "prompt": "x", "logprobs": 21}, 400, "logprobs"),
        ({"model": "tiny", "prompt": "x", "logit_bias": {"256": 1}}, 400, "logit_bias"),
        ({"model": "tiny", "prompt": "x", "min_tokens": 5, "max_tokens": 4}, 400, "min_tokens"),
    ],
)
def test_bad_requests_get_openai_errors(srv, body, status, param):
    r = srv.post(body)
    assert r.status_code == status
    assert r.json()["error"]["param"] == param and r.json()["error"]["message"]
    assert srv.post({"model": "tiny", "prompt": "a", "max_tokens": 2}).status_code == 200


@pytest.mark.parametrize(
    ("route", "body", "message"),
    [
        ("/v1/completions", {"max_token": 4}, "unknown parameter 'max_token'; did you mean 'max_tokens'?"),
        ("/v1/completions", {"temprature": 0}, "did you mean 'temperature'?"),
        ("/v1/completions", {"zzz": 1}, "unknown parameter 'zzz'"),
        (
            "/v1/chat/completions",
            {"guided_regex": "a"},
            "'guided_regex' is vLLM's older spelling: send structured_outputs.regex",
        ),
        ("/v1/chat/completions", {"functions": []}, "does no legacy function calling (send tools and tool_choice)"),
    ],
)
def test_unknown_fields_are_explained(srv, route, body, message):
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
    base = chat if "chat" in route else {"model": "tiny", "prompt": "x"}
    r = srv.post({**base, **body}, route)
    assert r.status_code == 400 and message in r.json()["error"]["message"], r.json()
    assert r.json()["error"]["param"] == next(iter(body))


def test_a_misspelt_required_field_is_named_as_the_typo(srv):
    r = srv.post({"model": "tiny", "promt": "x"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "promt"
    assert r.json()["error"]["message"] == "unknown parameter 'promt'; did you mean 'prompt'?"
    r = srv.post({"model": "tiny", "mesages": []}, "/v1/chat/completions")
    assert "did you mean 'messages'?" in r.json()["error"]["message"]


def test_every_vllm_field_is_served_or_refused_with_its_reason(srv):
    """Each field vLLM or OpenAI clients send that this server does not implement gets 400 naming
    it, "not supported" and what is missing; on the chat route and the completions route alike."""
    from laplace_jax.serve.routes import UNSUPPORTED

    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
    for field, reason in UNSUPPORTED.items():
        for route, base in (("/v1/chat/completions", chat), ("/v1/completions", {"model": "tiny", "prompt": "x"})):
            if field == "echo" and "chat" not in route:
                continue  # the completions route serves echo
            r = srv.post({**base, field: True}, route)
            err = r.json()["error"]
            assert r.status_code == 400 and err["param"] == field, (field, route, r.text)
            assert err["message"] == f"{field!r} is not supported: this server does no {reason}"


def test_a_request_id_names_the_response(srv):
    r = srv.post({"model": "tiny", "prompt": "x", "max_tokens": 1, "request_id": "abc-1"})
    assert r.json()["id"] == "cmpl-abc-1"
    with httpx.stream(
        "POST",
        srv.url + "/v1/chat/completions",
        json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "stream": True,
              "request_id": "xyz"},
    ) as s:  # fmt: skip
        ids = {json.loads(line[6:])["id"] for line in s.iter_lines() if line.startswith("data: {")}
    assert ids == {"chatcmpl-xyz"}


def test_malformed_json(srv):
    r = srv.post(content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "error" in r.json()


def test_queue_overflow_gives_429():
    s = Running(max_num_seqs=1, prefill_chunk=16, steps_per_call=1, max_queue=1, decode_buckets="1")
    try:
        body = {"model": "tiny", "prompt": "a", "max_tokens": 500, "ignore_eos": True}
        codes = []
        threads = [threading.Thread(target=lambda: codes.append(s.post(body))) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        statuses = sorted(r.status_code for r in codes)
        assert 429 in statuses and 200 in statuses
        r429 = next(r for r in codes if r.status_code == 429)
        assert r429.headers["retry-after"] == "1" and r429.json()["error"]["type"] == "rate_limit_error"
    finally:
        s.close()


WARM = """
import json, sys, jax
from laplace_jax.platform import set_compile_cache
set_compile_cache(sys.argv[1])
from laplace_jax import ModelConfig, init_params
from laplace_jax.serve.config import ServeConfig
from laplace_jax.serve.engine import Engine
from laplace_jax.serve.metrics import ServeMetrics
cfg = ModelConfig(vocab_size=256, d_model=64, n_layers=2, n_heads=2, use_short_conv=True, chunk_size=16)
m = ServeMetrics()
serve = ServeConfig(max_num_seqs=4, prefill_chunk=16, devices=1, prefix_cache_bytes=0)
e = Engine(cfg, init_params(cfg, jax.random.key(0)), serve, eos_id=0, metrics=m)
e.warmup()
print(json.dumps({"hits": m.cache_hits._value.get(), "misses": m.cache_misses._value.get()}))
"""


@pytest.mark.slow
def test_warm_compile_cache_restart_compiles_nothing(tmp_path):
    env = child_env()
    runs = [
        json.loads(
            subprocess.run(
                [sys.executable, "-c", WARM, str(tmp_path)], capture_output=True, text=True, env=env, check=True
            )
            .stdout.strip()
            .splitlines()[-1]
        )
        for _ in range(2)
    ]
    assert runs[0]["misses"] >= 6
    assert runs[1]["misses"] == 0 and runs[1]["hits"] >= 6


def test_bench_tool_against_the_server(srv, tmp_path):
    from laplace_jax.serve.bench import main

    out = tmp_path / "b.json"
    rc = main(
        [
            "--base-url",
            srv.url,
            "--model",
            "tiny",
            "--num-prompts",
            "8",
            "--input-len",
            "20",
            "--output-len",
            "12",
            "--request-rate",
            "50",
            "--max-concurrency",
            "4",
            "--out",
            str(out),
        ]
    )
    res = json.loads(out.read_text())
    assert rc == 0 and res["completed"] == 8 and res["failed"] == 0
    d = res["duration_s"]
    # ignore_eos: every request returns exactly --output-len tokens; the rates are those counts over the run
    assert res["output_throughput"] * d == pytest.approx(8 * 12) and res["request_throughput"] * d == pytest.approx(8)
    assert res["ttft_s"]["median"] < res["e2el_s"]["median"] <= res["e2el_s"]["p99"] <= d
    assert 0 < res["tpot_s"]["median"] < res["e2el_s"]["median"]


def start_serve_py(tmp_path, *extra: str, cpu_devices: int = 1) -> tuple[subprocess.Popen, str]:
    """serve.py on the tiny model in a subprocess with ``cpu_devices`` fake CPU devices; returns once
    /health says ready."""
    from laplace_jax.checkpoint import save_model

    save_model(str(tmp_path / "m"), CFG, PARAMS)
    port = portpicker.pick_unused_port()
    env = child_env(cpu_devices)
    args = ["--checkpoint", str(tmp_path / "m"), "--tokenizer", "byte", "--port", str(port), "--max-num-seqs", "2"]
    proc = subprocess.Popen(
        [sys.executable, "serve.py", *args, "--steps-per-call", "1", *extra],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        try:
            if httpx.get(url + "/health").status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"serve.py did not become ready: {proc.stderr.read()[-2000:]}")


def stream_then_sigterm(proc, url: str, body: dict) -> tuple[list[str], float]:
    """Stream ``body``; send SIGTERM after 3 lines. Returns (lines, seconds from SIGTERM to the end)."""
    import signal

    lines, t_sig = [], None
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
        for line in r.iter_lines():
            if line:
                lines.append(line)
            if len(lines) == 3:
                proc.send_signal(signal.SIGTERM)
                t_sig = time.perf_counter()
    return lines, time.perf_counter() - t_sig


@pytest.mark.slow
def test_sigterm_drains_in_flight_requests(tmp_path):
    import signal

    proc, url = start_serve_py(tmp_path, "--exact", "--access-log")  # exercises those switches end to end as well
    try:
        body = {"model": "m", "prompt": "abc", "max_tokens": 300, "stream": True, "ignore_eos": True}
        lines, _ = stream_then_sigterm(proc, url, body)
        assert lines[-1] == "data: [DONE]"
        finished = [json.loads(x[6:]) for x in lines if x.startswith("data: {")]
        assert finished[-1]["choices"][0]["finish_reason"] == "length"
        assert proc.wait(60) in (0, -signal.SIGTERM)  # uvicorn re-raises SIGTERM once it has drained
        out = proc.stdout.read()
        assert "(float32 compute, float32 weights, exact)" in out
        ready = r"^ready: \d+ programs compiled in [\d.]+ s; GLA kernels in them: (.*); speculative decoding: off; "
        ready += r"structured jump-forward: off \("
        kernels = re.search(ready, out, re.M).group(1).split(", ")  # read from the compiled HLO
        assert kernels == ["XLA chunk kernel (blocks layout)", "XLA GLA step", "XLA conv step"], out
        assert "GLA kernel over prompts: chunk (auto: the XLA kernel on cpu)" in out
        assert re.search(r"^stopped: 1 requests finished, 300 tokens generated \(http://", out, re.M), out
        assert '"POST /v1/completions HTTP/1.1" 200' in out  # the access log
    finally:
        proc.kill()


@pytest.mark.slow
def test_sigterm_is_bounded_by_the_drain_timeout(tmp_path):
    """A request that would run for minutes ends cleanly at the deadline, and the process exits."""
    import signal

    proc, url = start_serve_py(tmp_path, "--drain-timeout", "2", "--max-model-len", "100000")
    try:
        body = {"model": "m", "prompt": "abc", "max_tokens": 90_000, "stream": True, "ignore_eos": True}
        body["stream_options"] = {"include_usage": True}
        lines, seconds = stream_then_sigterm(proc, url, body)
        t0 = time.perf_counter()
        assert proc.wait(30) in (0, -signal.SIGTERM)
        exit_seconds = seconds + time.perf_counter() - t0
        assert lines[-1] == "data: [DONE]"
        chunks = [json.loads(x[6:]) for x in lines if x.startswith("data: {")]
        assert chunks[-2]["choices"][0]["finish_reason"] == "length"  # the last text chunk; then usage
        assert chunks[-1]["usage"]["completion_tokens"] < 90_000
        assert seconds < 2.0 and exit_seconds < 5.0, (seconds, exit_seconds)
    finally:
        proc.kill()


@pytest.mark.slow
def test_serve_py_spreads_slots_over_all_devices(tmp_path):
    """serve.py on 8 fake CPU devices (its default: all of them), bf16 weights: greedy text equals the
    reference decode of the bf16-weight model, and /metrics shows every device's occupancy."""
    proc, url = start_serve_py(tmp_path, "--weights-dtype", "bfloat16", cpu_devices=8)
    try:
        bodies = [{"model": "m", "prompt": f"dev {i}", "max_tokens": 12, "temperature": 0} for i in range(10)]
        with concurrent.futures.ThreadPoolExecutor(10) as pool:
            texts = list(pool.map(lambda b: httpx.post(url + "/v1/completions", json=b, timeout=120).json(), bodies))
        bf16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16), PARAMS)
        for b, r in zip(bodies, texts, strict=True):
            assert r["choices"][0]["text"] == TOK.decode(reference_greedy(TOK.encode(b["prompt"]), 12, params=bf16))
        metrics = httpx.get(url + "/metrics").text
        assert 'laplace:device_slots_used{device="7"}' in metrics
        assert "laplace:device_slots_total 2.0" in metrics
    finally:
        proc.kill()
    out = proc.stdout.read()
    assert "8 device(s) x 2 slots" in out and "bfloat16 weights" in out
