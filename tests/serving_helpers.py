"""A tiny served model, its reference greedy decode, and a server on a loopback port (serving tests)."""

import httpx
import jax
import jax.numpy as jnp
import openai
import portpicker

from laplace_jax import ModelConfig, decode_step, init_params, init_state
from laplace_jax.data.tokenizer import ByteTokenizer
from laplace_jax.serve.config import ServeConfig
from laplace_jax.serve.engine import Engine
from laplace_jax.serve.launch import BackgroundServer
from laplace_jax.serve.metrics import ServeMetrics
from laplace_jax.serve.routes import Server

CFG = ModelConfig(
    vocab_size=256, d_model=64, n_layers=2, n_heads=2, use_short_conv=True, chunk_size=16, init_std=0.3, max_seq_len=512
)
PARAMS = init_params(CFG, jax.random.key(0))
TOK = ByteTokenizer()


def serve_config(**kw) -> ServeConfig:
    """A ``ServeConfig`` for tests: one device, no prefix cache, max_model_len 2048 unless ``kw``
    says otherwise (small engines that compile fast and whose counts are not shared)."""
    return ServeConfig(**{"devices": 1, "prefix_cache_bytes": 0, "max_model_len": 2048, **kw})


def reference_greedy(ids, n, eos_id=TOK.eos_id, params=PARAMS, cfg=CFG):
    """The model's own recurrent path: decode_step over the prompt, then argmax until EOS or n tokens."""
    step = jax.jit(decode_step, static_argnums=0)
    state = init_state(cfg, 1)
    for t in ids:
        logits, state = step(cfg, params, jnp.asarray([t]), state)
    out = []
    for _ in range(n):
        t = int(jnp.argmax(logits[0]))
        if t == eos_id:
            break
        out.append(t)
        logits, state = step(cfg, params, jnp.asarray([t]), state)
    return out


class Running(BackgroundServer):
    """The tiny model served as "tiny"; ``serve_kw``: ``ServeConfig`` fields (``serve_config``'s
    defaults, with a 64 MiB prefix cache, as serve.py runs it)."""

    def __init__(self, tokenizer=TOK, eos_id=TOK.eos_id, params=PARAMS, **serve_kw):
        serve_kw = {"max_model_len": 512, "prefix_cache_bytes": 1 << 26, **serve_kw}
        self.engine = Engine(CFG, params, serve_config(**serve_kw), eos_id=eos_id, metrics=ServeMetrics())
        server = Server(self.engine, tokenizer, "tiny")
        super().__init__(server, portpicker.pick_unused_port())

    def client(self):
        return openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0)

    def post(self, body=None, route="/v1/completions", timeout=120.0, **kw):
        """POST ``body`` as JSON to ``route``, or raw bytes as ``content=`` (httpx's response; ``kw``:
        headers and the like). The one HTTP helper of the serving tests."""
        return httpx.post(self.url + route, json=body, timeout=timeout, **kw)
