"""The serving programs as pure functions of the slot buffers, traced for one ``SlotLayout``.

Slots: D devices x S slots each. Every slot buffer (each layer's state leaves and each sampling
row) leads with its slot axis of size D * S, sharded over ``data`` (device d holds global slots
d*S .. d*S + S - 1); the weights are replicated. Each program is one SPMD executable over all
D devices (``programs.DevicePrograms`` compiles them at warmup):

  grammar   write rows of the structured-output table [R, T, 128] (replicated on every
            device; ``sampling.grammar_tiles``): the next state per (state, token) of the automata
            and host grammars in use (``serve/structured.py``), int16
  prefill   tokens [D, P] (row d for device d; length 0 = no request) -> states [D], last logits [D, V]
  score     prefill that also scores each position's next token (prompt logprobs: echo, lm-eval)
  insert    row d's prefilled state and sampling row into device d's local slot i_d (i_d < 0: none);
            samples the first tokens (and their logprobs)
  decode[W] ``steps`` tokens (and their logprobs) for the first W local slots of every device
            (W: the per-device bucket); a step at which no row is live (each is done, or waits for
            its host grammar's next mask) skips the model
  move      per device, copy local slot src_d into dst_d (compaction; src_d == dst_d: nothing)
  snapshot  per device, a copy of local slot i_d's model state (the prefix cache's end entries)

A finished row's state stays as it was after its last fed token (decode treats a done row's
token as padding, which leaves its state bit for bit), so a snapshot is the state after the
prompt and the generated tokens fed back. Every program works on the per-device view
[D, S, ..] of the slot axis, so no data crosses devices.
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
from laplace_jax.sampling import count_tokens, grammar_limit, grammar_next, penalize, sample_rows, token_logprobs
from laplace_jax.serve.structured import HELD


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
        "gstate": ((), jnp.int32, -1),  # the row's structured-output state (a grammar table row), -1: none
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
    "gstate",
)
GRAMMAR_BLOCK = 32  # grammar-table rows written per call (one compiled shape)
GRAMMAR_DTYPE = jnp.int16  # grammar-table entries: a row index or -1 (``ServeConfig.structured_states`` <= 32767)


def _split(x: jax.Array, D: int) -> jax.Array:
    """[D*S, ..] -> [D, S, ..] (the per-device view)."""
    return x.reshape(D, x.shape[0] // D, *x.shape[1:])


def _join(x: jax.Array) -> jax.Array:
    return x.reshape(x.shape[0] * x.shape[1], *x.shape[2:])


@dataclasses.dataclass(frozen=True)
class SlotLayout:
    """What the programs are traced for: the model, the ``data`` mesh over the D devices, the
    sampling keys' PRNG implementation, the tokens per decode call and the grammar table's rows."""

    cfg: ModelConfig
    mesh: Mesh
    prng: str
    steps_per_call: int
    grammar_rows: int  # rows of the structured-output table (``ServeConfig.structured_states``)

    @property
    def D(self) -> int:
        return self.mesh.size

    def slot_sharding(self) -> NamedSharding:
        """Every slot buffer [slots, ..] (state leaves and sampling rows): the slot axis over the devices."""
        return NamedSharding(self.mesh, P("data"))

    def constrain(self, tree: Any) -> Any:
        return jax.lax.with_sharding_constraint(tree, self.slot_sharding())

    def replicated(self) -> NamedSharding:
        return NamedSharding(self.mesh, P())


def grammar_program(table_RxTxL, rows_B, block_BxTxL):
    """Write ``block`` into rows ``rows`` of the grammar table (a row index >= R: nothing)."""
    return table_RxTxL.at[rows_B].set(block_BxTxL, mode="drop")


def prefill_program(lay: SlotLayout, params, tokens_DxP, state, lengths_D, logits_DxV, next_DxP=None):
    """Advance each row's state over its chunk; keep its last real logits. With ``next_DxP``
    (each position's following prompt token) also return that token's logprob and the top
    logprobs at every position (the ``score`` program)."""
    logits, state = prefill(lay.cfg, params, tokens_DxP, state, lengths_D)
    last = jnp.take_along_axis(logits, jnp.maximum(lengths_D - 1, 0)[:, None, None], axis=1)[:, 0]
    last = jnp.where((lengths_D > 0)[:, None], last, logits_DxV)
    last = lay.constrain(last)
    if next_DxP is None:
        return last, state
    return last, state, token_logprobs(logits, next_DxP)


def insert_program(lay: SlotLayout, slots, grammar_RxTxL, state_D, logits_DxV, req_D, local_D):
    D, V = lay.D, lay.cfg.vocab_size
    keys = jax.random.wrap_key_data(req_D["key"], impl=lay.prng)
    fresh = dict(req_D, count=jnp.zeros((D,), jnp.int32), counts=jnp.zeros((D, V), jnp.int32))
    limited = grammar_limit(penalize(logits_DxV, fresh), logits_DxV, grammar_RxTxL, req_D["gstate"])
    first = sample_rows(
        limited,
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

    def put_all(x, new):  # x [D*S, ..], new [D, ..]
        return _join(jax.vmap(put)(_split(x, D), new, idx, on))

    model = jax.tree.map(put_all, slots["model"], state_D)
    new_rows = dict(
        req_D,
        token=first,
        count=jnp.ones((D,), jnp.int32),
        counts=count_tokens(fresh["counts"], first, jnp.ones((D,), bool)),
        done=jnp.zeros((D,), bool),
        gstate=grammar_next(grammar_RxTxL, req_D["gstate"], first, jnp.ones((D,), bool)),
    )
    rows = {k: put_all(slots["rows"][k], new_rows[k]) for k in slots["rows"]}
    return lay.constrain({"model": model, "rows": rows}), first, token_logprobs(logits_DxV, first)


def decode_program(lay: SlotLayout, params, slots, grammar_RxTxL, W: int):
    D = lay.D

    def take(x):  # the first W local slots of every device, flattened to D*W rows
        return _join(jax.lax.slice_in_dim(_split(x, D), 0, W, axis=1))

    def give(x, sub):
        return _join(jax.lax.dynamic_update_slice_in_dim(_split(x, D), _split(sub, D), 0, 1))

    sub = jax.tree.map(take, slots)

    def step(sub, _):
        r = sub["rows"]
        # a done row keeps its final state (the prefix cache's end entry); a row whose host grammar
        # has not written its next mask yet (its table row all HELD) waits, state and all
        held = (r["gstate"] >= 0) & (grammar_RxTxL[jnp.maximum(r["gstate"], 0), 0, 0] == HELD)
        valid = ~r["done"] & ~held

        def run(sub):
            logits, model = decode_step(lay.cfg, params, r["token"], sub["model"], valid)
            keys = jax.vmap(jax.random.fold_in)(jax.random.wrap_key_data(r["key"], impl=lay.prng), r["count"])
            limited = grammar_limit(penalize(logits, r), logits, grammar_RxTxL, r["gstate"])
            tok = sample_rows(limited, r["temperature"], r["top_k"], r["top_p"], keys, r["min_p"])
            tok = jnp.where(valid, tok, r["token"])
            gstate = grammar_next(grammar_RxTxL, r["gstate"], tok, valid)
            remaining = r["remaining"] - valid
            stop = jnp.take_along_axis(r["stop_mask"], tok[:, None], axis=-1)[:, 0]
            done = r["done"] | (valid & (stop | (remaining <= 0)))
            counts = count_tokens(r["counts"], tok, valid)
            rows = dict(
                r, token=tok, count=r["count"] + 1, remaining=remaining, done=done, counts=counts, gstate=gstate
            )
            return lay.constrain({"model": model, "rows": rows}), (tok, token_logprobs(logits, tok))

        def idle(sub):  # every row done or waiting for the host: the rest of the call skips the model
            shapes = jax.eval_shape(run, sub)[1][1]
            rows = dict(r, count=r["count"] + 1)
            return lay.constrain({"model": sub["model"], "rows": rows}), (r["token"], jax.tree.map(_zeros, shapes))

        sub, (tok, lps) = jax.lax.cond(jnp.any(valid), run, idle, sub)
        return sub, (tok, valid, lps)

    sub, (toks, valid, lps) = jax.lax.scan(step, lay.constrain(sub), None, length=lay.steps_per_call)
    K = lay.steps_per_call
    lps = jax.tree.map(lambda x: x.reshape(K, D, W, *x.shape[2:]), lps)
    return lay.constrain(jax.tree.map(give, slots, sub)), toks.reshape(K, D, W), valid.reshape(K, D, W), lps


def _zeros(shape: jax.ShapeDtypeStruct) -> jax.Array:
    return jnp.zeros(shape.shape, shape.dtype)


def move_program(lay: SlotLayout, slots, src_D, dst_D):
    D = lay.D

    def mv(buf_S, s, d):
        return jax.lax.dynamic_update_index_in_dim(buf_S, jax.lax.dynamic_index_in_dim(buf_S, s, 0, True), d, 0)

    return lay.constrain(jax.tree.map(lambda x: _join(jax.vmap(mv)(_split(x, D), src_D, dst_D)), slots))


def snapshot_program(lay: SlotLayout, slots, local_D):
    D = lay.D

    def take(x):  # x [D*S, ..] -> [D, ..]: local slot local_D[d] of device d
        return jax.vmap(lambda b, i: jax.lax.dynamic_index_in_dim(b, i, 0, keepdims=False))(_split(x, D), local_D)

    return lay.constrain(jax.tree.map(take, slots["model"]))
