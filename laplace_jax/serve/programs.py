"""The engine's device side: slot buffers sharded over a ``data`` mesh axis and their compiled programs.

Slots: D devices x S slots each. Every slot buffer has its slot axis of size D * S sharded over
``data`` (device d holds global slots d*S .. d*S + S - 1); the weights are replicated. Each
program is one SPMD executable over all D devices, AOT-compiled at warmup:

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
prompt and the generated tokens fed back.
Prefix-cache entries are per-device buffers: ``row_state`` takes device d's row of a [.., D, ..]
state without a copy and ``assemble`` builds the prefill's starting state from such rows (no
compile, no copy when each row already lives on its device).

Every program works on the per-device view [.., D, S, ..] of the slot axis, so no data crosses
devices. The slot buffers are donated through insert, decode and move.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from laplace_jax.config import ModelConfig
from laplace_jax.models.gla_lm import decode_step, init_state, pack_weights, prefill
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


class DevicePrograms:
    """Slot buffers on ``devices`` and the prefill / insert / decode / move executables."""

    def __init__(
        self,
        cfg: ModelConfig,
        params: Any,
        devices: Sequence[jax.Device],
        slots_per_device: int,
        prefill_chunk: int,
        steps_per_call: int,
        prng: str = "threefry2x32",
    ):
        self.cfg, self.prng = cfg, prng
        self.D, self.S = len(devices), slots_per_device  # devices, slots per device
        self.prefill_chunk, self.steps_per_call = prefill_chunk, steps_per_call
        self.mesh = Mesh(np.asarray(devices), ("data",))
        self.params = jax.device_put(pack_weights(params), NamedSharding(self.mesh, P()))
        self.executables: dict[tuple[str, int], Any] = {}
        self.slots = self.new_slots()
        self.fresh = self._put_model(init_state(cfg, self.D))  # prefill's starting states, one per device
        self.state_bytes = sum(x.nbytes for x in jax.tree.leaves(init_state(cfg, 1)))
        self.prefilled_tokens = 0  # prompt ids run through prefill (what the prefix cache saves)

    # ----- shardings ----------------------------------------------------------------------
    def _model_sharding(self) -> NamedSharding:
        return NamedSharding(self.mesh, P(None, "data"))

    def _row_sharding(self) -> NamedSharding:
        return NamedSharding(self.mesh, P("data"))

    def _put_model(self, tree):
        return jax.device_put(tree, self._model_sharding())

    def _constrain(self, slots: dict) -> dict:
        return {
            "model": jax.lax.with_sharding_constraint(slots["model"], self._model_sharding()),
            "rows": jax.lax.with_sharding_constraint(slots["rows"], self._row_sharding()),
        }

    def new_slots(self) -> dict:
        """Fresh slot buffers (every slot idle), sharded over the devices."""
        n = self.D * self.S
        rows = {
            k: np.full((n, *shape), idle, dtype)
            for k, (shape, dtype, idle) in row_template(self.prng, self.cfg.vocab_size).items()
        }
        return {
            "model": self._put_model(init_state(self.cfg, n)),
            "rows": jax.device_put(rows, self._row_sharding()),
        }

    # ----- the programs (traced functions) ------------------------------------------------
    def _prefill(self, params, tokens_DxP, state, lengths_D, logits_DxV, next_DxP=None):
        """Advance each row's state over its chunk; keep its last real logits. With ``next_DxP``
        (each position's following prompt token) also return that token's logprob and the top
        logprobs at every position (the ``score`` program)."""
        logits, state = prefill(self.cfg, params, tokens_DxP, state, lengths_D)
        last = jnp.take_along_axis(logits, jnp.maximum(lengths_D - 1, 0)[:, None, None], axis=1)[:, 0]
        last = jnp.where((lengths_D > 0)[:, None], last, logits_DxV)
        last = jax.lax.with_sharding_constraint(last, self._row_sharding())
        if next_DxP is None:
            return last, state
        return last, state, token_logprobs(logits, next_DxP)

    def _insert(self, slots, state_D, logits_DxV, req_D, local_D):
        D, V = self.D, self.cfg.vocab_size
        keys = jax.random.wrap_key_data(req_D["key"], impl=self.prng)
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
        return self._constrain({"model": model, "rows": rows}), first, token_logprobs(logits_DxV, first)

    def _decode(self, params, slots, W: int):
        D = self.D

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
            logits, model = decode_step(self.cfg, params, r["token"], sub["model"], ~r["done"])
            keys = jax.vmap(jax.random.fold_in)(jax.random.wrap_key_data(r["key"], impl=self.prng), r["count"])
            tok = sample_rows(penalize(logits, r), r["temperature"], r["top_k"], r["top_p"], keys, r["min_p"])
            valid = ~r["done"]
            tok = jnp.where(valid, tok, r["token"])
            remaining = r["remaining"] - valid
            stop = jnp.take_along_axis(r["stop_mask"], tok[:, None], axis=-1)[:, 0]
            done = r["done"] | (valid & (stop | (remaining <= 0)))
            counts = count_tokens(r["counts"], tok, valid)
            rows = dict(r, token=tok, count=r["count"] + 1, remaining=remaining, done=done, counts=counts)
            return self._constrain({"model": model, "rows": rows}), (tok, valid, token_logprobs(logits, tok))

        sub, (toks, valid, lps) = jax.lax.scan(step, self._constrain(sub), None, length=self.steps_per_call)
        model = jax.tree.map(lambda x, s: give(x, s, MODEL_SLOT_AXIS), slots["model"], sub["model"])
        rows = jax.tree.map(lambda x, s: give(x, s, 0), slots["rows"], sub["rows"])
        K = self.steps_per_call
        lps = jax.tree.map(lambda x: x.reshape(K, D, W, *x.shape[2:]), lps)
        return self._constrain({"model": model, "rows": rows}), toks.reshape(K, D, W), valid.reshape(K, D, W), lps

    def _move(self, slots, src_D, dst_D):
        D = self.D

        def mv(buf_S, s, d):
            return jax.lax.dynamic_update_index_in_dim(buf_S, jax.lax.dynamic_index_in_dim(buf_S, s, 0, True), d, 0)

        def move_model(x):
            xs = jnp.moveaxis(_split(x, MODEL_SLOT_AXIS, D), 1, 0)  # [D, L, S, ..]
            out = jax.vmap(lambda b, s, d: jax.vmap(mv, (0, None, None))(b, s, d))(xs, src_D, dst_D)
            return _join(jnp.moveaxis(out, 0, 1), MODEL_SLOT_AXIS)

        model = jax.tree.map(move_model, slots["model"])
        rows = jax.tree.map(lambda x: _join(jax.vmap(mv)(_split(x, 0, D), src_D, dst_D), 0), slots["rows"])
        return self._constrain({"model": model, "rows": rows})

    def _snapshot(self, slots, local_D):
        D = self.D

        def take(x):  # x [L, D*S, ..] -> [L, D, ..]: local slot local_D[d] of device d
            xs = jnp.moveaxis(_split(x, MODEL_SLOT_AXIS, D), 1, 0)  # [D, L, S, ..]
            out = jax.vmap(lambda b, i: jax.lax.dynamic_index_in_dim(b, i, 1, keepdims=False))(xs, local_D)
            return jnp.moveaxis(out, 0, 1)

        return jax.lax.with_sharding_constraint(jax.tree.map(take, slots["model"]), self._model_sharding())

    # ----- compilation --------------------------------------------------------------------
    def _abstract(self, tree, sharding):
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), tree)

    def programs(self, widths: Sequence[int]) -> list[tuple]:
        """(name, width, fn, abstract args, donated argnums) for every executable serving needs."""
        D, V = self.D, self.cfg.vocab_size
        rows = self._row_sharding()
        state_D = self._abstract(jax.eval_shape(lambda: init_state(self.cfg, D)), self._model_sharding())
        logits = jax.ShapeDtypeStruct((D, V), jnp.float32, sharding=rows)
        ints = jax.ShapeDtypeStruct((D,), jnp.int32, sharding=rows)
        tokens = jax.ShapeDtypeStruct((D, self.prefill_chunk), jnp.int32, sharding=rows)
        tpl = row_template(self.prng, self.cfg.vocab_size)
        req = {k: jax.ShapeDtypeStruct((D, *tpl[k][0]), tpl[k][1], sharding=rows) for k in REQUEST_FIELDS}
        slots = self._abstract_slots()
        out = [
            ("prefill", D, self._prefill, (self.params, tokens, state_D, ints, logits), ()),
            ("score", D, self._prefill, (self.params, tokens, state_D, ints, logits, tokens), ()),
            ("insert", D, self._insert, (slots, state_D, logits, req, ints), (0,)),
            ("move", D, self._move, (slots, ints, ints), (0,)),
            ("snapshot", D, self._snapshot, (slots, ints), ()),
        ]
        return out + [self.decode_program(w) for w in widths]

    def _abstract_slots(self) -> dict:
        return {
            "model": self._abstract(self.slots["model"], self._model_sharding()),
            "rows": self._abstract(self.slots["rows"], self._row_sharding()),
        }

    def decode_program(self, width: int) -> tuple:
        fn = lambda params, slots, W=width: self._decode(params, slots, W)  # noqa: E731
        return ("decode", width, fn, (self.params, self._abstract_slots()), (1,))

    def compile(self, name: str, width: int, fn: Callable, args: tuple, donate: tuple[int, ...]):
        compiled = jax.jit(fn, donate_argnums=donate).lower(*args).compile()
        self.executables[(name, width)] = compiled
        return compiled

    def get(self, name: str, width: int):
        return self.executables.get((name, width))

    # ----- host calls ---------------------------------------------------------------------
    def prefill_rows(
        self,
        prompts: dict[int, list[int]],
        score: bool = False,
        starts: dict[int, tuple[int, Any]] | None = None,
        on_block: Callable[[int, int, Any], None] | None = None,
        block: int = 0,
    ):
        """Prefill prompt ``prompts[d]`` on device d (others idle): (states [D], last logits [D, V],
        scores). With ``score``: scores[d] is the prompt's ``TokenLogprob`` list (None for its first
        token, which nothing predicts); else scores is None.

        ``starts[d] = (n, state)``: row d resumes from ``state`` (one sequence's state, on any
        device), the state after its first n ids, and prefills the rest (not with ``score``).
        ``on_block(d, n, state)`` is called with row d's state (on device d) each time a full
        prefill call ends at a multiple n of ``block`` ids."""
        D, P_ = self.D, self.prefill_chunk
        starts = starts or {}
        if score and starts:
            raise ValueError("scoring a prompt needs every position: it cannot resume from a cached state")
        state = self.assemble({d: s for d, (_, s) in starts.items()}) if starts else self.fresh
        logits = np.zeros((D, self.cfg.vocab_size), np.float32)
        offset = {d: starts[d][0] if d in starts else 0 for d in prompts}
        longest = max(len(ids) - offset[d] for d, ids in prompts.items())
        ex = self.executables[("score" if score else "prefill", D)]
        scores: dict[int, list] | None = {d: [None] for d in prompts} if score else None
        for start in range(0, longest, P_):
            chunk = np.zeros((D, P_), np.int32)
            nxt = np.zeros((D, P_), np.int32)
            lengths = np.zeros((D,), np.int32)
            for d, ids in prompts.items():
                at = offset[d] + start
                piece, following = ids[at : at + P_], ids[at + 1 : at + P_ + 1]
                chunk[d, : len(piece)] = piece
                nxt[d, : len(following)] = following
                lengths[d] = len(piece)
            self.prefilled_tokens += int(lengths.sum())
            if not score:
                logits, state = ex(self.params, chunk, state, lengths, logits)
            else:
                logits, state, (lp, top_ids, top_lp) = ex(self.params, chunk, state, lengths, logits, nxt)
                lp, top_ids, top_lp = np.asarray(lp).tolist(), np.asarray(top_ids).tolist(), np.asarray(top_lp).tolist()
                for d, ids in prompts.items():  # position j scores token j + 1 of the prompt
                    n = max(0, min(P_, len(ids) - 1 - start))
                    scores[d].extend((lp[d][j], top_ids[d][j], top_lp[d][j]) for j in range(n))
            if on_block is not None:
                for d in prompts:
                    end = offset[d] + start + P_
                    if lengths[d] == P_ and end % block == 0:
                        on_block(d, end, self.row_state(state, d))
        return state, logits, scores

    def row_state(self, state_D, d: int):
        """Device d's row of a [L, D, ..] state: one sequence's state on device d (no copy)."""
        dev = self.mesh.devices.flat[d]
        return jax.tree.map(lambda x: next(s.data for s in x.addressable_shards if s.device == dev), state_D)

    def assemble(self, rows: dict[int, Any]):
        """A [L, D, ..] starting state whose row d is ``rows[d]`` (one sequence's state, copied to
        device d if it lives elsewhere) and a fresh state elsewhere. No compile."""

        def build(fresh, *given):
            by_device = dict(zip(rows, given, strict=True))
            own = {s.device: s.data for s in fresh.addressable_shards}
            shards = []
            for d, dev in enumerate(self.mesh.devices.flat):
                x = by_device.get(d)
                if x is None:
                    x = own[dev]
                elif x.devices() != {dev}:
                    x = jax.device_put(x, dev)
                shards.append(x)
            return jax.make_array_from_single_device_arrays(fresh.shape, fresh.sharding, shards)

        return jax.tree.map(build, self.fresh, *rows.values())

    def snapshot(self, local: dict[int, int]) -> dict[int, Any]:
        """Device d's local slot ``local[d]`` model state, copied out: {d: one sequence's state}."""
        idx = np.zeros((self.D,), np.int32)
        for d, i in local.items():
            idx[d] = i
        state = self.executables[("snapshot", self.D)](self.slots, idx)
        return {d: self.row_state(state, d) for d in local}

    def insert(self, state, logits, requests: dict[int, tuple[int, dict]]):
        """Write device d's prefilled row into its local slot ``requests[d][0]`` with sampling row
        ``requests[d][1]``; returns the first sampled token per device [D] (host) and its
        (logprob [D], top ids [D, k], top logprobs [D, k]) (device)."""
        D, tpl = self.D, row_template(self.prng, self.cfg.vocab_size)
        req = {k: np.full((D, *tpl[k][0]), tpl[k][2], tpl[k][1]) for k in REQUEST_FIELDS}
        local = np.full((D,), -1, np.int32)
        for d, (slot, row) in requests.items():
            local[d] = slot
            for k in REQUEST_FIELDS:
                req[k][d] = row[k]
        self.slots, first, lps = self.executables[("insert", D)](self.slots, state, logits, req, local)
        return np.asarray(first), lps

    def decode(self, width: int) -> tuple[np.ndarray, np.ndarray, tuple[jax.Array, ...]]:
        """``steps`` tokens for the first ``width`` local slots of each device: (tokens, valid)
        [K, D, W] on the host, and the tokens' (logprob [K, D, W], top ids and top logprobs
        [K, D, W, k]) left on the device (read them only when a request wants them)."""
        self.slots, toks, valid, lps = self.executables[("decode", width)](self.params, self.slots)
        return np.asarray(toks), np.asarray(valid), lps

    def move(self, moves: dict[int, tuple[int, int]]) -> None:
        """Per device d, copy local slot moves[d][0] into moves[d][1]."""
        src = np.zeros((self.D,), np.int32)
        dst = np.zeros((self.D,), np.int32)
        for d, (s, t) in moves.items():
            src[d], dst[d] = s, t
        self.slots = self.executables[("move", self.D)](self.slots, src, dst)
