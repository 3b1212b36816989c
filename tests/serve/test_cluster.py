"""Serving past one server: the worker contract routers read (server info, load, vLLM-named
metrics, the fields sglang-router adds), and serve.py replicas behind the real sglang-router
(the openai client through it, prefix affinity, a replica killed and restarted, a different
model refused)."""

import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import jax
import openai
import portpicker
import pytest
from helpers import child_env
from prometheus_client.parser import text_string_to_metric_families
from serving_helpers import CFG

from laplace_jax import init_params
from laplace_jax.checkpoint import save_model
from laplace_jax.serve.cli import parse
from laplace_jax.serve.metrics import sample_sum

ROUTER_BODY = {  # what sglang-router 0.3 forwards for a plain {"model", "prompt", "max_tokens"} request
    "stream": False,
    "echo": False,
    "no_stop_trim": False,
    "ignore_eos": False,
    "skip_special_tokens": True,
    "return_hidden_states": False,
}


def test_the_worker_contract_routers_read(srv):
    info = httpx.get(srv.url + "/get_server_info").json()
    assert info == httpx.get(srv.url + "/server_info").json()
    assert info["served_model_name"] == "tiny" and info["max_model_len"] == srv.engine.max_model_len
    assert info["max_num_seqs"] == 4 and len(info["model_fingerprint"]) == 16
    load = httpx.get(srv.url + "/get_load").json()
    assert set(load[0]) == {"dp_rank", "num_reqs", "num_waiting_reqs", "num_tokens"}
    body = {"model": "tiny", "prompt": "a shared prefix", "max_tokens": 4, **ROUTER_BODY}
    assert srv.post(body).status_code == 200
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 4}
    chat |= {"continue_final_message": False, "separate_reasoning": True, "stream_reasoning": True, **ROUTER_BODY}
    chat.pop("echo")
    assert srv.post(chat, "/v1/chat/completions").status_code == 200
    refused = srv.post({**body, "no_stop_trim": True})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "no_stop_trim"
    assert "always trimmed" in refused.json()["error"]["message"]


def test_vllm_named_metrics_carry_the_same_values(srv):
    srv.post({"model": "tiny", "prompt": "count me", "max_tokens": 3})
    text = httpx.get(srv.url + "/metrics").text
    for ours, theirs in [
        ("laplace:generation_tokens_total", "vllm:generation_tokens_total"),
        ("laplace:prompt_tokens_total", "vllm:prompt_tokens_total"),
        ("laplace:num_requests_waiting", "vllm:num_requests_waiting"),
        ("laplace:time_to_first_token_seconds_count", "vllm:time_to_first_token_seconds_count"),
    ]:
        assert sample_sum(text, theirs, model_name="tiny") == sample_sum(text, ours) > -1, theirs
    used = sample_sum(text, "laplace:device_slots_used")
    assert sample_sum(text, "vllm:gpu_cache_usage_perc") == used / 4
    hits = sample_sum(text, "vllm:prefix_cache_hits_total")
    queries = sample_sum(text, "vllm:prefix_cache_queries_total")
    assert sample_sum(text, "vllm:gpu_prefix_cache_hit_rate") == pytest.approx(hits / queries)
    names = {f.name for f in text_string_to_metric_families(text)}
    assert {"vllm:num_requests_running", "vllm:kv_cache_usage_perc", "vllm:e2e_request_latency_seconds"} <= names


def test_served_model_name_is_spelled_as_vllm_spells_it():
    assert parse(["--served-model-name", "laplace-3b"]).model_name == "laplace-3b"
    assert parse(["--model-name", "laplace-3b"]).model_name == "laplace-3b"


def _model_dir(path, seed: int) -> str:
    save_model(str(path), CFG, init_params(CFG, jax.random.key(seed)))
    return str(path)


def _launch(args: list[str], log) -> subprocess.Popen:
    env = child_env()  # each replica: one CPU device
    cmd = [sys.executable, "-m", "laplace_jax.serve.cluster", *args]
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def _wait_for(predicate, timeout: float, what: str) -> float:
    t0 = time.monotonic()
    while not predicate():
        assert time.monotonic() - t0 < timeout, what
        time.sleep(0.25)
    return time.monotonic() - t0


def _healthy(router: str) -> dict[str, bool]:
    try:
        return {w["url"]: w["is_healthy"] for w in httpx.get(router + "/workers", timeout=5).json()["workers"]}
    except httpx.HTTPError:
        return {}


def _prefix_hits(url: str) -> float:
    return sample_sum(httpx.get(url + "/metrics", timeout=10).text, "laplace:prefix_cache_hits_total")


@pytest.mark.slow
def test_replicas_behind_sglang_router(tmp_path):
    """Two replicas and the router from one command: the openai client unmodified through it,
    requests sharing a long prefix land where it is cached, a replica killed under load costs only
    the requests in flight on it and is seen down within 10 s, then rejoins, warmed from the
    compile cache the replicas share; a replica of another model is refused."""
    model = _model_dir(tmp_path / "tiny", 0)
    port = portpicker.pick_unused_port()
    while any(not portpicker.is_port_free(port + i) for i in (1, 2)):
        port = portpicker.pick_unused_port()
    router, replicas = f"http://127.0.0.1:{port}", [f"http://127.0.0.1:{port + i}" for i in (1, 2)]
    serve = ["--checkpoint", model, "--tokenizer", "byte", "--max-num-seqs", "4", "--max-model-len", "512"]
    serve += ["--compile-cache-dir", str(tmp_path / "compile_cache")]  # shared: a restart re-warms from it
    log = open(tmp_path / "cluster.log", "wb")  # noqa: SIM115 (the launcher writes it until the end)
    proc = _launch(["--replicas", "2", "--port", str(port), "--restart", "--log-dir", str(tmp_path), "--", *serve], log)
    try:
        _wait_for(lambda: len(_healthy(router)) == 2 or proc.poll() is not None, 300, "the cluster did not start")
        assert proc.poll() is None, (tmp_path / "cluster.log").read_text()
        client = openai.OpenAI(base_url=router + "/v1", api_key="none", max_retries=0)
        assert [m.id for m in client.models.list().data] == ["tiny"]
        prefix = "You are a careful assistant. " * 8
        for i in range(6):  # the same long prefix: cache_aware keeps it on one replica
            out = client.completions.create(
                model="tiny", prompt=prefix + f"question {i}", max_tokens=4, extra_body={"ignore_eos": True}
            )
            assert out.usage.completion_tokens == 4
        hits = [_prefix_hits(u) for u in replicas]
        assert sorted(hits)[0] == 0 and sorted(hits)[1] >= 4, hits
        chunks = client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=4,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content) >= 1

        _kill_one_under_load(router, replicas[0], port + 1)
        _wait_for(lambda: _healthy(router).get(replicas[0]) is True, 240, "the restarted replica did not rejoin")
        metrics = httpx.get(replicas[0] + "/metrics", timeout=10).text  # its warmup read the others' programs
        assert sample_sum(metrics, "laplace:compile_cache_hits_total") > 0

        _fronts_servers_started_elsewhere(tmp_path, replicas)
        _another_model_is_refused(tmp_path, replicas[1])
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(90)
        log.close()
    assert "stopped 3 process(es)" in (tmp_path / "cluster.log").read_text()
    assert not [p for p in (port, port + 1, port + 2) if not portpicker.is_port_free(p)]


def _healthy_server(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def _kill_one_under_load(router: str, victim_url: str, victim_port: int) -> None:
    """SIGKILL the replica on ``victim_port`` while three clients load the router: only requests in
    flight on it may fail, with a 5xx at once (no hang); the router sees it down within 10 s."""
    results, stop = [], threading.Event()

    def load(i: int) -> None:
        with httpx.Client(timeout=30) as c:
            n = 0
            while not stop.is_set():
                body = {"model": "tiny", "prompt": f"{i}-{n}", "max_tokens": 8}
                t = time.monotonic()
                try:
                    r = c.post(router + "/v1/completions", json=body)
                    results.append((t, r.status_code, r.text if r.status_code != 200 else ""))
                except httpx.HTTPError as e:  # a hang past the timeout or a dropped connection
                    results.append((t, type(e).__name__, str(e)))
                n += 1

    threads = [threading.Thread(target=load, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    try:
        time.sleep(2)
        victim = int(subprocess.check_output(["pgrep", "-f", "--", f"--port {victim_port}"]).split()[0])
        killed = time.monotonic()
        os.kill(victim, signal.SIGKILL)
        seen = _wait_for(lambda: _healthy(router).get(victim_url) is False, 30, "the router never saw it down")
        time.sleep(2)
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert seen <= 10
    failed = [r for r in results if r[1] != 200]
    print(f"{len(results)} requests, {len(failed)} failed: {failed[:3]}")
    assert len(results) > 20 and all(isinstance(code, int) and code >= 500 for _, code, _ in failed), failed
    assert all(killed - 1 < t < killed + seen for t, _, _ in failed), failed  # only those caught by the kill


def _fronts_servers_started_elsewhere(tmp_path, replicas: list[str]) -> None:
    """The across-hosts launch: ``--worker-urls`` puts a second router over servers the launcher did not
    start (addressed as two hosts would be); requests flow, and stopping it leaves those servers up."""
    port = portpicker.pick_unused_port()
    urls = [replicas[0].replace("127.0.0.1", "localhost"), replicas[1]]
    log = open(tmp_path / "hosts.log", "wb")  # noqa: SIM115 (the launcher writes it until the end)
    proc = _launch(["--worker-urls", *urls, "--port", str(port), "--log-dir", str(tmp_path / "hosts")], log)
    try:
        router = f"http://127.0.0.1:{port}"
        _wait_for(lambda: len(_healthy(router)) == 2 or proc.poll() is not None, 120, "the router did not start")
        client = openai.OpenAI(base_url=router + "/v1", api_key="none", max_retries=0)
        for i in range(4):
            out = client.completions.create(
                model="tiny", prompt=f"host {i}", max_tokens=3, extra_body={"ignore_eos": True}
            )
            assert out.usage.completion_tokens == 3
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(60)
        log.close()
    assert "stopped 1 process(es)" in (tmp_path / "hosts.log").read_text()  # the router only
    assert all(_healthy_server(u) for u in replicas)


def _another_model_is_refused(tmp_path, replica: str) -> None:
    """A server of other weights under the same name, fronted with ``replica``: the launcher refuses."""
    other = _model_dir(tmp_path / "other", 1)
    other_port = portpicker.pick_unused_port()
    env = child_env()
    cmd = [sys.executable, "-m", "laplace_jax.serve.cli", "--checkpoint", other, "--tokenizer", "byte"]
    odd = subprocess.Popen([*cmd, "--model-name", "tiny", "--port", str(other_port)], env=env)
    try:
        other_url = f"http://127.0.0.1:{other_port}"
        _wait_for(lambda: _healthy_server(other_url), 120, "the other server did not start")
        refused = subprocess.run(
            [sys.executable, "-m", "laplace_jax.serve.cluster", "--worker-urls", replica, other_url,
             "--log-dir", str(tmp_path / "refused")],
            capture_output=True, text=True, env=env, timeout=120,
        )  # fmt: skip
        assert refused.returncode == 2 and "serve different models, refused" in refused.stderr
    finally:
        odd.terminate()
        odd.wait(30)
