"""What a router asks a worker, in SGLang's contract: ``/get_server_info`` (= ``/server_info``),
``/model_info`` (= ``/get_model_info``) and ``/get_load``; and the fingerprint by which the
cluster launcher tells that two workers serve the same model."""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import json
from typing import Any

from fastapi import FastAPI

from laplace_jax.serve.engine import Engine


def model_fingerprint(engine: Engine, tokenizer: Any, weights_id: str) -> str:
    """16 hex digits of a hash of the model config, the tokenizer and ``weights_id`` (what
    identifies the weights' bytes: ``cli.weights_id``)."""
    facts = [dataclasses.asdict(engine.cfg), type(tokenizer).__name__, tokenizer.vocab_size, tokenizer.eos_id]
    return hashlib.sha256(json.dumps([*facts, weights_id], default=str).encode()).hexdigest()[:16]


def add_worker_routes(app: FastAPI, engine: Engine, model_name: str, fingerprint: str) -> None:
    @app.get("/get_server_info")
    @app.get("/server_info")
    async def server_info():  # routers list the model by served_model_name
        return {
            "served_model_name": model_name,
            "model_fingerprint": fingerprint,
            "max_model_len": engine.max_model_len,
            "max_num_seqs": engine.slots_per_device * engine.n_devices,
            "devices": engine.n_devices,
            "state_bytes_per_sequence": engine.state_bytes,
            "status": engine.status()[0],
            "version": importlib.metadata.version("laplace-jax"),
        }

    @app.get("/model_info")
    @app.get("/get_model_info")
    async def model_info():  # what SGLang's router asks a new worker; no model_path: nothing to download
        return {"served_model_name": model_name, "is_generation": True, "model_path": None}

    @app.get("/get_load")
    async def get_load():  # SGLang's load report (its power_of_two policy polls it)
        running, waiting = engine.counts()
        # num_tokens is SGLang's KV-cache tokens in use: a fixed-size state holds none per token
        return [{"dp_rank": 0, "num_reqs": running + waiting, "num_waiting_reqs": waiting, "num_tokens": 0}]
