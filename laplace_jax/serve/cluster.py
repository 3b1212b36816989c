"""Replicas of serve.py behind an existing router (SGLang's Rust gateway, sglang-router), started,
watched and stopped as one.

    python -m laplace_jax.serve.cluster --replicas 2 --port 8000 -- --checkpoint runs/tiny --max-num-seqs 8
    python -m laplace_jax.serve.cluster --worker-urls http://10.0.0.2:8001 http://10.0.0.3:8001 --port 8000

1. Replica i runs ``serve.py`` with the arguments after ``--`` on port ``--port + 1 + i``; with
   ``--devices-per-replica N`` it sees only its own group of N devices (through ``--device-env``:
   CUDA_VISIBLE_DEVICES on GPUs, TPU_VISIBLE_CHIPS on TPUs, NEURON_RT_VISIBLE_CORES on Trainium).
   ``--worker-urls`` instead puts the router in front of servers started elsewhere (one per host).
2. Every replica must answer ``/health``; one that exits first is reported with the end of its log.
3. Every replica must serve the same model: its ``/get_server_info`` ``served_model_name`` and
   ``model_fingerprint`` (config, tokenizer and the weights' checksums) must agree, or nothing starts.
4. The router starts over them (``--policy cache_aware`` by default: a request goes to the replica
   whose past requests share the longest prefix with it, which is where its prefix state is cached),
   and the command prints one line when the router answers.
5. SIGINT / SIGTERM stop the router, then the replicas (SIGTERM: each drains its requests), and
   kill whatever remains after ``--stop-timeout`` seconds. With ``--restart`` a replica that exits
   is started again on its port; the router's health check takes it back.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field

import httpx

from laplace_jax.errors import UserError

POLICIES = ("cache_aware", "round_robin", "power_of_two", "random")


@dataclass
class Child:
    """A process the launcher owns: its command, environment and log file."""

    name: str
    cmd: list[str]
    env: dict[str, str]
    log: str
    url: str = ""
    proc: subprocess.Popen | None = field(default=None, repr=False)

    def start(self) -> None:
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(
                self.cmd, env=self.env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def tail(self, lines: int = 12) -> str:
        with open(self.log, errors="replace") as f:
            return "".join(f.readlines()[-lines:])

    def signal(self, sig: int) -> None:
        if self.alive():
            os.killpg(self.proc.pid, sig)


def _get(url: str, timeout: float = 2.0) -> httpx.Response | None:
    try:
        return httpx.get(url, timeout=timeout)
    except httpx.HTTPError:
        return None


def wait_healthy(children: list[Child], timeout: float, path: str = "/health") -> None:
    """Every child answers 200 on ``path``; a child that exits, or the timeout, is a UserError."""
    deadline, waiting = time.monotonic() + timeout, list(children)
    while waiting:
        for c in list(waiting):
            if c.proc is not None and not c.alive():
                raise UserError(f"{c.name} exited ({c.proc.returncode}) before it was ready; its log ends:\n{c.tail()}")
            r = _get(c.url + path)
            if r is not None and r.status_code == 200:
                waiting.remove(c)
        if waiting and time.monotonic() > deadline:
            names = ", ".join(c.name for c in waiting)
            raise UserError(f"{names} not ready after {timeout:g} s (see {waiting[0].log})")
        time.sleep(0.5)


def check_same_model(urls: list[str]) -> dict:
    """Every worker's /get_server_info; they must agree on the model (name and fingerprint)."""
    infos = {}
    for url in urls:
        r = _get(url + "/get_server_info", timeout=10)
        if r is None or r.status_code != 200:
            raise UserError(f"{url}/get_server_info did not answer: is it a laplace-jax serve.py?")
        infos[url] = r.json()
    models = {(i["served_model_name"], i["model_fingerprint"]) for i in infos.values()}
    if len(models) > 1:
        listed = "; ".join(f"{u}: {i['served_model_name']} ({i['model_fingerprint']})" for u, i in infos.items())
        raise UserError(f"the replicas serve different models, refused: {listed}")
    return next(iter(infos.values()))


def replica_children(a: argparse.Namespace) -> list[Child]:
    children = []
    for i in range(a.replicas):
        env = dict(os.environ)
        if a.devices_per_replica:
            group = range(i * a.devices_per_replica, (i + 1) * a.devices_per_replica)
            env[a.device_env] = ",".join(map(str, group))
        port = a.port + 1 + i
        cmd = [sys.executable, "-m", "laplace_jax.serve.cli", *a.serve_args, "--host", a.host, "--port", str(port)]
        url = f"http://{a.host}:{port}"
        children.append(Child(f"replica {i}", cmd, env, os.path.join(a.log_dir, f"replica_{i}.log"), url))
    return children


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def router_child(a: argparse.Namespace, urls: list[str]) -> Child:
    cmd = [sys.executable, "-m", "sglang_router.launch_router", "--worker-urls", *urls, "--policy", a.policy]
    cmd += ["--host", a.host, "--port", str(a.port), "--log-level", "warn"]
    cmd += ["--prometheus-host", a.host, "--prometheus-port", str(a.router_metrics_port or free_port(a.host))]
    cmd += ["--health-check-interval-secs", "2", "--health-failure-threshold", "2", "--health-success-threshold", "1"]
    cmd += ["--request-timeout-secs", str(a.request_timeout), *a.router_args]
    return Child("router", cmd, dict(os.environ), os.path.join(a.log_dir, "router.log"), f"http://{a.host}:{a.port}")


def stop(children: list[Child], timeout: float) -> None:
    """SIGTERM to all (the router first), then SIGKILL to whatever is left after ``timeout``."""
    for c in children:
        c.signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for c in children:
        if c.proc is not None:
            try:
                c.proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                c.signal(signal.SIGKILL)
                c.proc.wait()


class StopSignalError(Exception):
    """SIGINT or SIGTERM arrived: stop everything started so far."""


def _on_signal(sig: int, _frame) -> None:
    raise StopSignalError(signal.Signals(sig).name)


def supervise(router: Child, replicas: list[Child], restart: bool) -> int:
    """Watch until a signal (``StopSignalError``) or the router's exit; restart replicas that exit when asked."""
    while True:
        if not router.alive():
            print(f"router exited ({router.proc.returncode}); its log ends:\n{router.tail()}", file=sys.stderr)
            return 1
        for c in replicas:
            if not c.alive():
                print(f"{c.name} exited ({c.proc.returncode}){'; restarting it' if restart else ''}", flush=True)
                if restart:
                    c.start()
                else:
                    c.proc = None
        time.sleep(0.5)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m laplace_jax.serve.cluster",
        description="serve.py replicas behind sglang-router, started and stopped as one (docs/serving.md, Replicas)",
        epilog="Arguments after -- go to every serve.py replica (e.g. -- --checkpoint runs/tiny --max-num-seqs 8).",
    )
    ap.add_argument("--replicas", type=int, default=2, help="serve.py processes to start on this host")
    ap.add_argument("--worker-urls", nargs="+", help="servers started elsewhere instead (one per host)")
    ap.add_argument("--router", choices=("sglang",), default="sglang", help="the router (sglang-router's gateway)")
    ap.add_argument("--policy", choices=POLICIES, default="cache_aware", help="the router's routing policy")
    ap.add_argument("--host", default="127.0.0.1", help="address of the router and the local replicas")
    ap.add_argument("--port", type=int, default=8000, help="the router's port; replica i listens on port + 1 + i")
    ap.add_argument("--router-metrics-port", type=int, help="the router's Prometheus port (default: a free one)")
    ap.add_argument("--devices-per-replica", type=int, help="give each replica its own group of this many devices")
    ap.add_argument("--device-env", default="CUDA_VISIBLE_DEVICES", help="the variable that names a device group")
    ap.add_argument("--ready-timeout", type=float, default=900, help="seconds to wait for the replicas' warmup")
    ap.add_argument("--request-timeout", type=int, default=600, help="the router's per-request timeout, seconds")
    ap.add_argument("--stop-timeout", type=float, default=60, help="seconds the replicas get to drain on stop")
    ap.add_argument("--restart", action="store_true", help="start a replica again when it exits")
    ap.add_argument("--log-dir", default="cluster_logs", help="each process's output goes to a file here")
    ap.add_argument("--router-arg", dest="router_args", action="append", default=[], help="extra router flag")
    return ap


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ours, serve_args = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    a = parser().parse_args(ours)
    a.serve_args = serve_args
    os.makedirs(a.log_dir, exist_ok=True)
    replicas = [] if a.worker_urls else replica_children(a)
    started: list[Child] = []
    for sig in (signal.SIGINT, signal.SIGTERM):  # from here on a signal stops whatever has started
        signal.signal(sig, _on_signal)
    try:
        for c in replicas:
            c.start()
            started.append(c)
        wait_healthy(replicas, a.ready_timeout)
        urls = a.worker_urls or [c.url for c in replicas]
        info = check_same_model(urls)
        router = router_child(a, urls)
        router.start()
        started.insert(0, router)
        wait_healthy([router], 120, "/v1/models")
        print(
            f"serving {info['served_model_name']!r} on {router.url} through sglang-router ({a.policy}) over "
            f"{len(urls)} replica(s): {' '.join(urls)}; logs in {a.log_dir}/",
            flush=True,
        )
        return supervise(router, replicas, a.restart)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except StopSignalError:
        return 0
    finally:
        stop(started, a.stop_timeout)
        if started:
            print(f"stopped {len(started)} process(es)", flush=True)


if __name__ == "__main__":
    sys.exit(main())
