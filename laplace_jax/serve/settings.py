"""The serving defaults, in one place: engine sizes and HTTP limits. ``serve.py``'s flags,
``Engine``, ``Server`` and ``launch`` take their defaults from here (the sampling defaults are
``request.SamplingParams``' own)."""

from __future__ import annotations

# engine
MAX_NUM_SEQS = 8  # decode slots per device
PREFILL_CHUNK = 64  # tokens per prefill call
STEPS_PER_CALL = 4  # decode tokens per device dispatch
MAX_QUEUE = 64  # waiting requests before 429
PREFIX_CACHE_BYTES = "1G"  # prefix-state cache budget per device (serve.py's flag; Engine's default is 0: off)
# HTTP
DRAIN_TIMEOUT_S = 30.0  # SIGTERM to exit
MAX_BODY_BYTES = 1 << 20  # request body cap (413 above it)
BODY_TIMEOUT_S = 30.0  # a body that has not arrived by then gets 408
HEADER_TIMEOUT_S = 10.0  # a connection that has not sent a request head by then is closed
KEEP_ALIVE_S = 5.0  # an idle kept-alive connection stays open this long
MAX_CONNECTIONS = 1024  # open connections; more are closed as they arrive
