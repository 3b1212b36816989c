"""Running the server: uvicorn with connection limits, the signal-driven drain, and a thread
runner for notebooks, benchmarks and tests.

Connection limits (uvicorn has none for idle sockets): a connection that has not sent a complete
request head within ``header_timeout`` seconds (a new connection, or a kept-alive one that
started a next request) is closed, and connections beyond ``max_connections`` are closed as
they arrive, so idle sockets cannot exhaust the server's file descriptors. Idle kept-alive
connections close after ``keep_alive`` seconds (uvicorn's own timer).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import threading
import time
from collections.abc import Callable

import httpx
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from laplace_jax.serve.routes import Server


def guarded_h11(header_timeout: float, max_connections: int) -> type[H11Protocol]:
    """uvicorn's h11 protocol with a request-head timeout and a connection cap."""

    class Guarded(H11Protocol):
        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            if len(self.connections) > max_connections:
                transport.close()
                return
            self._arm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm()

        def _arm(self) -> None:
            armed = self.cycle
            self.loop.call_later(header_timeout, self._expire, armed)

        def _expire(self, armed) -> None:
            """Close if no new request head arrived since arming (``cycle`` unchanged)."""
            idle = armed is None or armed.response_complete
            if self.cycle is armed and idle and not self.transport.is_closing():
                self.transport.close()

    return Guarded


class _Uvicorn(uvicorn.Server):
    """uvicorn that starts the engine's drain the moment SIGTERM/SIGINT arrives, so the drain and
    uvicorn's graceful wait run at once, both bounded by the server's ``drain_timeout``."""

    def __init__(self, config: uvicorn.Config, on_exit: Callable[[], None]):
        super().__init__(config)
        self._on_exit = on_exit

    def handle_exit(self, sig, frame) -> None:
        self._on_exit()
        super().handle_exit(sig, frame)


def make_uvicorn(server: Server, host: str, port: int, log_level: str = "warning") -> uvicorn.Server:
    """uvicorn for ``server`` with the connection limits of ``server.engine.serve``."""
    cfg = server.engine.serve
    config = uvicorn.Config(
        server.app,
        host=host,
        port=port,
        log_level=log_level,
        http=guarded_h11(cfg.header_timeout, cfg.max_connections),
        timeout_keep_alive=math.ceil(cfg.keep_alive),
        timeout_graceful_shutdown=math.ceil(server.drain_timeout),
    )
    return _Uvicorn(config, server.begin_shutdown)


class BackgroundServer:
    """Run a ``Server`` with uvicorn in a thread on a loopback port (notebooks, benchmarks, tests)."""

    def __init__(self, server: Server, port: int, host: str = "127.0.0.1", ready_timeout: float = 600.0):
        self.server, self.url = server, f"http://{host}:{port}"
        self.uv = make_uvicorn(server, host, port, log_level="error")
        self.thread = threading.Thread(target=self.uv.run, daemon=True)
        t0 = time.perf_counter()
        self.thread.start()
        while time.perf_counter() - t0 < ready_timeout:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.url + "/health").status_code == 200:
                    self.ready_seconds = time.perf_counter() - t0
                    return
            state, message = server.engine.status()
            if state == "dead":
                raise RuntimeError(message)
            time.sleep(0.1)
        raise TimeoutError(f"server not ready after {ready_timeout} s ({server.warm_progress})")

    def close(self) -> None:
        self.server.begin_shutdown()
        self.uv.should_exit = True
        self.thread.join(60)
