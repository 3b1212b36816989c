"""The serving programs as pure functions of the slot buffers, traced for one ``SlotLayout``.

Slots: D devices x S slots each. Every slot buffer has its slot axis of size D * S sharded over
``data`` (device d holds global slots d*S .. d*S + S - 1); the weights are replicated. Each
program is one SPMD executable over all D devices (``programs.DevicePrograms`` compiles them at
warmup):

  prefill   tokens [D, P] (row d for device d; length 0 = no request) -> states [D], last logits [D, V]
  score     prefill that also scores each position's next token (prompt logprobs: echo, lm-eval)
  insert    row d's prefilled state and sampling row into device d's local slot i_d (i_d < 0: none);
            samples the first tokens (and their logprobs)
  decode[W] ``steps`` tokens (and their logprobs) for the first W local slots of every device
            (W: the per-device bucket)
  move      per device, copy local slot src_d into dst_d (compaction; src_d == dst_d: nothing)
  snapshot  per device, a copy of local slot i_d's model state (the prefix cache's end entries)

A finished row's state stays as it was after its last fed token (decode treats a done row's
token as padding, which leaves its state bit for bit), so a snapshot is the state after the
prompt and the generated tokens fed back. Every program works on the per-device view
[.., D, S, ..] of the slot axis, so no data crosses devices.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from laplace_jax.config import ModelConfig
from laplace_jax.models.gla_lm import decode_step, prefill
from laplace_jax.platform import key_words
from laplace_jax.sampling import count_tokens, penalize, sample_rows, token_logprobs

MODEL_SLOT_AXIS = 1  # state leaves are [L, slots, ...]


def row_template(prng: str, vocab_size: int) -> dict[str, tuple[tuple[int, ...], Any, Any]]:
    """Per-slot sampling fields: name -> (shape, dtype, idle value); ``prng``: the keys' implementation.

    The vocabulary-wide rows (``bias``, ``seen``, ``stop_mask``, ``counts``) hold the penalties'
    inputs: 10 bytes per token id per slot (0.5 MB per slot for the 3B model's 50,304 ids, 1.7% of
    its 29.5 MB state)."""
    return {
        "token": ((), jnp.int32, 0),
        "temperature": ((), jnp.float32, 0.0),
        "top_k": ((), jnp.int32, 0),
        "top_p": ((), jnp.float32, 1.0),
        "min_p": ((), jnp.float32, 0.0),
        "key": ((key_words(prng),), jnp.uint32, 0),
        "count": ((), jnp.int32, 0),
        "remaining": ((), jnp.int32, 0),
        "min_tokens": ((), jnp.int32, 0),
        "presence": ((), jnp.float32, 0.0),
        "frequency": ((), jnp.float32, 0.0),
        "repetition": ((), jnp.float32, 1.0),
        "bias": ((vocab_size,), jnp.float32, 0.0),
        "seen": ((vocab_size,), jnp.bool_, False),
        "stop_mask": ((vocab_size,), jnp.bool_, False),
        "counts": ((vocab_size,), jnp.int32, 0),
        "done": ((), jnp.bool_, True),
    }


REQUEST_FIELDS = (  # set per request at insert; the rest are the decode loop's own
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "key",
    "remaining",
    "min_tokens",
    "presence",
    "frequency",
    "repetition",
    "bias",
    "seen",
    "stop_mask",
)


def _split(x: jax.Array, axis: int, D: int) -> jax.Array:
    """[.., D*S, ..] -> [.., D, S, ..] (the per-device view)."""
    return x.reshape(*x.shape[:axis], D, x.shape[axis] // D, *x.shape[axis + 1 :])


def _join(x: jax.Array, axis: int) -> jax.Array:
    return x.reshape(*x.shape[:axis], x.shape[axis] * x.shape[axis + 1], *x.shape[axis + 2 :])


@dataclasses.dataclass(frozen=True)
class SlotLayout:
    """What the programs are traced for: the model, the ``data`` mesh over the D devices, the
    sampling keys' PRNG implementation and the tokens per decode call."""

    cfg: ModelConfig
    mesh: Mesh
    prng: str
    steps_per_call: int

    @property
    def D(self) -> int:
        return self.mesh.size

    def model_sharding(self) -> NamedSharding:
        """State leaves [L, slots, ..]: the slot axis over the devices."""
        return NamedSharding(self.mesh, P(None, "data"))

    def row_sharding(self) -> NamedSharding:
        """Per-slot rows [slots, ..]: the slot axis over the devices."""
        return NamedSharding(self.mesh, P("data"))

    def constrain(self, slots: dict) -> dict:
        return {
            "model": jax.lax.with_sharding_constraint(slots["model"], self.model_sharding()),
            "rows": jax.lax.with_sharding_constraint(slots["rows"], self.row_sharding()),
        }


def prefill_program(lay: SlotLayout, params, tokens_DxP, state, lengths_D, logits_DxV, next_DxP=None):
    """Advance each row's state over its chunk; keep its last real logits. With ``next_DxP``
    (each position's following prompt token) also return that token's logprob and the top
    logprobs at every position (the ``score`` program)."""
    logits, state = prefill(lay.cfg, params, tokens_DxP, state, lengths_D)
    last = jnp.take_along_axis(logits, jnp.maximum(lengths_D - 1, 0)[:, None, None], axis=1)[:, 0]
    last = jnp.where((lengths_D > 0)[:, None], last, logits_DxV)
    last = jax.lax.with_sharding_constraint(last, lay.row_sharding())
    if next_DxP is None:
        return last, state
    return last, state, token_logprobs(logits, next_DxP)


def insert_program(lay: SlotLayout, slots, state_D, logits_DxV, req_D, local_D):
    D, V = lay.D, lay.cfg.vocab_size
    keys = jax.random.wrap_key_data(req_D["key"], impl=lay.prng)
    fresh = dict(req_D, count=jnp.zeros((D,), jnp.int32), counts=jnp.zeros((D, V), jnp.int32))
    first = sample_rows(
        penalize(logits_DxV, fresh),
        req_D["temperature"],
        req_D["top_k"],
        req_D["top_p"],
        jax.vmap(jax.random.fold_in, (0, None))(keys, 0),
        req_D["min_p"],
    )
    on = local_D >= 0
    idx = jnp.maximum(local_D, 0)

    def put(buf_S, new, i, use):  # one device's slots; an unused row rewrites slot 0 with itself
        old = jax.lax.dynamic_index_in_dim(buf_S, i, 0, keepdims=True)
        return jax.lax.dynamic_update_index_in_dim(buf_S, jnp.where(use, new[None].astype(buf_S.dtype), old), i, 0)

    def put_model(x, new):  # x [L, D*S, ..], new [L, D, ..]
        xs = jnp.moveaxis(_split(x, MODEL_SLOT_AXIS, D), 1, 0)  # [D, L, S, ..]
        out = jax.vmap(lambda b, n, i, u: jax.vmap(put, (0, 0, None, None))(b, n, i, u))(
            xs, jnp.moveaxis(new, 1, 0), idx, on
        )
        return _join(jnp.moveaxis(out, 0, 1), MODEL_SLOT_AXIS)

    model = jax.tree.map(put_model, slots["model"], state_D)
    new_rows = dict(
        req_D,
        token=first,
        count=jnp.ones((D,), jnp.int32),
        counts=count_tokens(fresh["counts"], first, jnp.ones((D,), bool)),
        done=jnp.zeros((D,), bool),
    )
    rows = {k: _join(jax.vmap(put)(_split(slots["rows"][k], 0, D), new_rows[k], idx, on), 0) for k in slots["rows"]}
    return lay.constrain({"model": model, "rows": rows}), first, token_logprobs(logits_DxV, first)


def decode_program(lay: SlotLayout, params, slots, W: int):
    D = lay.D

    def take(x, axis):  # the first W local slots of every device, flattened to D*W rows
        return _join(jax.lax.slice_in_dim(_split(x, axis, D), 0, W, axis=axis + 1), axis)

    def give(x, sub, axis):
        out = jax.lax.dynamic_update_slice_in_dim(_split(x, axis, D), _split(sub, axis, D), 0, axis + 1)
        return _join(out, axis)

    sub = {
        "model": jax.tree.map(lambda x: take(x, MODEL_SLOT_AXIS), slots["model"]),
        "rows": jax.tree.map(lambda x: take(x, 0), slots["rows"]),
    }

    def step(sub, _):
        r = sub["rows"]
        # a done row keeps its final state (the prefix cache's end entry)
        logits, model = decode_step(lay.cfg, params, r["token"], sub["model"], ~r["done"])
        keys = jax.vmap(jax.random.fold_in)(jax.random.wrap_key_data(r["key"], impl=lay.prng), r["count"])
        tok = sample_rows(penalize(logits, r), r["temperature"], r["top_k"], r["top_p"], keys, r["min_p"])
        valid = ~r["done"]
        tok = jnp.where(valid, tok, r["token"])
        remaining = r["remaining"] - valid
        stop = jnp.take_along_axis(r["stop_mask"], tok[:, None], axis=-1)[:, 0]
        done = r["done"] | (valid & (stop | (remaining <= 0)))
        counts = count_tokens(r["counts"], tok, valid)
        rows = dict(r, token=tok, count=r["count"] + 1, remaining=remaining, done=done, counts=counts)
        return lay.constrain({"model": model, "rows": rows}), (tok, valid, token_logprobs(logits, tok))

    sub, (toks, valid, lps) = jax.lax.scan(step, lay.constrain(sub), None, length=lay.steps_per_call)
    model = jax.tree.map(lambda x, s: give(x, s, MODEL_SLOT_AXIS), slots["model"], sub["model"])
    rows = jax.tree.map(lambda x, s: give(x, s, 0), slots["rows"], sub["rows"])
    K = lay.steps_per_call
    lps = jax.tree.map(lambda x: x.reshape(K, D, W, *x.shape[2:]), lps)
    return lay.constrain({"model": model, "rows": rows}), toks.reshape(K, D, W), valid.reshape(K, D, W), lps


def move_program(lay: SlotLayout, slots, src_D, dst_D):
    D = lay.D

    def mv(buf_S, s, d):
        return jax.lax.dynamic_update_index_in_dim(buf_S, jax.lax.dynamic_index_in_dim(buf_S, s, 0, True), d, 0)

    def move_model(x):
        xs = jnp.moveaxis(_split(x, MODEL_SLOT_AXIS, D), 1, 0)  # [D, L, S, ..]
        out = jax.vmap(lambda b, s, d: jax.vmap(mv, (0, None, None))(b, s, d))(xs, src_D, dst_D)
        return _join(jnp.moveaxis(out, 0, 1), MODEL_SLOT_AXIS)

    model = jax.tree.map(move_model, slots["model"])
    rows = jax.tree.map(lambda x: _join(jax.vmap(mv)(_split(x, 0, D), src_D, dst_D), 0), slots["rows"])
    return lay.constrain({"model": model, "rows": rows})


def snapshot_program(lay: SlotLayout, slots, local_D):
    D = lay.D

    def take(x):  # x [L, D*S, ..] -> [L, D, ..]: local slot local_D[d] of device d
        xs = jnp.moveaxis(_split(x, MODEL_SLOT_AXIS, D), 1, 0)  # [D, L, S, ..]
        out = jax.vmap(lambda b, i: jax.lax.dynamic_index_in_dim(b, i, 1, keepdims=False))(xs, local_D)
        return jnp.moveaxis(out, 0, 1)

    return jax.lax.with_sharding_constraint(jax.tree.map(take, slots["model"]), lay.model_sharding())
