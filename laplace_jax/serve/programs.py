"""The engine's device side: the slot buffers, sharded over a ``data`` mesh axis, and the host
calls that run the compiled programs of ``slot_programs`` on them.

The slot buffers are donated through insert, decode and move. Prefix-cache entries are
per-device buffers: ``row_state`` takes device d's row of a [.., D, ..] state without a copy and
``assemble`` builds the prefill's starting state from such rows (no compile, no copy when each
row already lives on its device).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Collection, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from laplace_jax.config import ModelConfig
from laplace_jax.hlo_stats import gla_kernels
from laplace_jax.models.gla_lm import init_state, pack_weights, unstack_weights
from laplace_jax.platform import two_core_tpu
from laplace_jax.sampling import grammar_tiles, grammar_tiles_shape
from laplace_jax.serve.slot_programs import (
    GRAMMAR_BLOCK,
    GRAMMAR_DTYPE,
    SlotLayout,
    decode_program,
    grammar_program,
    insert_program,
    move_program,
    prefill_program,
    snapshot_program,
)
from laplace_jax.speculative import NgramSpec


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
        prng: str,
        grammar_rows: int,
        speculation: NgramSpec | None = None,
        max_model_len: int = 0,
        jump_forward: int = 0,
    ):
        """``prng``: the sampling keys' implementation, resolved (``platform.prng_impl``);
        ``grammar_rows``: the structured-output table's rows (automaton states held at once);
        ``speculation``: n-gram speculative decoding (each row's history holds ``max_model_len`` ids);
        ``jump_forward``: without speculation, the forced tokens a decode step verifies (0: none)."""
        self.cfg, self.prng = cfg, prng
        self.D, self.S = len(devices), slots_per_device  # devices, slots per device
        self.prefill_chunk, self.steps_per_call = prefill_chunk, steps_per_call
        self.mesh = Mesh(np.asarray(devices), ("data",))
        self.layout = SlotLayout(
            cfg, self.mesh, prng, steps_per_call, grammar_rows, speculation, max_model_len, jump_forward
        )
        self.speculation_counts = np.zeros((3,), np.int64)  # drafts, draft tokens, accepted tokens (device counts)
        self.template, self.fields = self.layout.row_template(), self.layout.request_fields()  # per-slot row fields
        self.params = jax.device_put(placed_weights(cfg, params, devices[0]), NamedSharding(self.mesh, P()))
        self.executables: dict[tuple[str, int], Any] = {}
        self.slots = self.new_slots()
        self.grammar = self.new_grammar()
        self.fresh = jax.device_put(
            init_state(cfg, self.D), self.layout.slot_sharding()
        )  # prefill's starting states, one per device
        self.state_bytes = sum(x.nbytes for x in jax.tree.leaves(init_state(cfg, 1)))
        self.prefilled_tokens = 0  # prompt ids run through prefill (what the prefix cache saves)
        self.step_counts = {  # decode's steps argument, on the devices once (no transfer per call)
            n: jax.device_put(np.int32(n), self.layout.replicated()) for n in {1, steps_per_call}
        }

    def new_slots(self) -> dict:
        """Fresh slot buffers (every slot idle), sharded over the devices."""
        n = self.D * self.S
        rows = {k: np.full((n, *shape), idle, dtype) for k, (shape, dtype, idle) in self.template.items()}
        return {
            "model": jax.device_put(init_state(self.cfg, n), self.layout.slot_sharding()),
            "rows": jax.device_put(rows, self.layout.slot_sharding()),
        }

    def new_grammar(self) -> jax.Array:
        """An empty structured-output table [grammar_rows, V] (no token allowed), on every device."""
        table = np.full((self.layout.grammar_rows, self.cfg.vocab_size), -1, GRAMMAR_DTYPE)
        return jax.device_put(grammar_tiles(table), self.layout.replicated())

    # ----- compilation --------------------------------------------------------------------
    def programs(self, widths: Sequence[int]) -> list[tuple]:
        """(name, width, fn, abstract args, donated argnums) for every executable serving needs."""
        return serving_programs(self.layout, self.params, self.S, self.prefill_chunk, widths)

    def decode_program(self, width: int) -> tuple:
        return serving_programs(self.layout, self.params, self.S, self.prefill_chunk, [width])[-1]

    def compile(self, name: str, width: int, fn: Callable, args: tuple, donate: tuple[int, ...]):
        compiled = jax.jit(fn, donate_argnums=donate).lower(*args).compile()
        self.executables[(name, width)] = compiled
        return compiled

    def gla_kernels(self) -> list[str]:
        """The GLA kernels the compiled executables run (``hlo_stats.gla_kernels`` of each one's HLO)."""
        found: dict[str, None] = {}
        for compiled in self.executables.values():
            found.update(dict.fromkeys(gla_kernels(compiled.as_text() or "")))
        return list(found)

    def get(self, name: str, width: int):
        return self.executables.get((name, width))

    # ----- host calls ---------------------------------------------------------------------
    def prefill_rows(
        self,
        prompts: dict[int, list[int]],
        score: bool = False,
        starts: dict[int, tuple[int, Any]] | None = None,
        keep: dict[int, Collection[int]] | None = None,
    ):
        """Prefill prompt ``prompts[d]`` on device d (others idle): (states [D], last logits [D, V],
        scores, blocks). With ``score``: scores[d] is the prompt's ``TokenLogprob`` list (None for
        its first token, which nothing predicts); else scores is None.

        ``starts[d] = (n, state)``: row d resumes from ``state`` (one sequence's state, on any
        device), the state after its first n ids, and prefills the rest (not with ``score``).
        ``blocks``: (d, n, row d's state on device d) for each n in ``keep[d]`` at which a full
        prefill call of row d ends."""
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
        keep, blocks = keep or {}, []
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
            for d in prompts:
                end = offset[d] + start + P_
                if lengths[d] == P_ and end in keep.get(d, ()):
                    blocks.append((d, end, self.row_state(state, d)))
        return state, logits, scores, blocks

    def row_state(self, state_D, d: int):
        """Device d's row of a state whose leaves are [D, ..]: one sequence's state on device d (no copy)."""
        dev = self.mesh.devices.flat[d]
        return jax.tree.map(lambda x: next(s.data for s in x.addressable_shards if s.device == dev), state_D)

    def assemble(self, rows: dict[int, Any]):
        """A starting state (leaves [D, ..]) whose row d is ``rows[d]`` (one sequence's state, copied to
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
        D, tpl, fields = self.D, self.template, self.fields
        req = {k: np.full((D, *tpl[k][0]), tpl[k][2], tpl[k][1]) for k in fields}
        local = np.full((D,), -1, np.int32)
        for d, (slot, row) in requests.items():
            local[d] = slot
            for k in fields:
                if k == "history":  # the ids so far (prompt and jump-forward), then their count
                    ids = row["history"]
                    req[k][d, : len(ids)] = ids
                    req["hlen"][d] = len(ids)
                elif k != "hlen":
                    req[k][d] = row[k]
        self.slots, first, lps = self.executables[("insert", D)](self.slots, self.grammar, state, logits, req, local)
        return np.asarray(first), lps

    def launch(self, width: int, steps: int | None = None) -> tuple:
        """Dispatch one decode call of ``steps`` (1 or ``steps_per_call``, the default: the later
        steps skip the model) for the first ``width`` local slots of each device, without waiting
        for it; ``read`` its result."""
        count = self.step_counts[steps or self.steps_per_call]
        self.slots, *out = self.executables[("decode", width)](self.params, self.slots, self.grammar, count)
        return tuple(out)

    def read(self, launched: tuple) -> tuple[np.ndarray, np.ndarray, tuple[jax.Array, ...]]:
        """A launched call's (tokens, valid) [K, D, W] on the host (K = steps x positions per step;
        a row's real tokens in order), and the tokens' (logprob [K, D, W], top ids and top
        logprobs [K, D, W, k]) left on the device (read them only when a request wants them).
        Adds the call's speculation counters to ``speculation_counts``."""
        toks, valid, lps, counts = launched
        if self.layout.speculation is not None:  # (zeros otherwise: no transfer)
            self.speculation_counts += np.asarray(counts)
        return np.asarray(toks), np.asarray(valid), lps

    def decode(self, width: int, steps: int | None = None) -> tuple[np.ndarray, np.ndarray, tuple[jax.Array, ...]]:
        """One decode call, waited for: ``read(launch(width, steps))``."""
        return self.read(self.launch(width, steps))

    def write_grammar(self, writes: Sequence[tuple[int, np.ndarray]]) -> None:
        """Put each (first row, rows [N, V]: entries already table rows, or negative) into the
        grammar table, in order (a later write of a row wins), all of them in ``GRAMMAR_BLOCK``-row
        calls (rows from any number of writes share a call)."""
        if not writes:
            return
        R, V = self.layout.grammar_rows, self.cfg.vocab_size
        rows = np.concatenate([r for _, r in writes])
        where = np.concatenate([np.arange(base, base + len(r)) for base, r in writes])
        _, last = np.unique(where[::-1], return_index=True)  # each row's last write
        keep = np.sort(len(where) - 1 - last)
        rows, where = rows[keep], where[keep]
        for at in range(0, len(rows), GRAMMAR_BLOCK):
            piece = rows[at : at + GRAMMAR_BLOCK]
            block = np.full((GRAMMAR_BLOCK, V), -1, GRAMMAR_DTYPE)
            block[: len(piece)] = piece
            index = np.full((GRAMMAR_BLOCK,), R, np.int32)  # R: past the end, dropped
            index[: len(piece)] = where[at : at + GRAMMAR_BLOCK]
            self.grammar = self.executables[("grammar", self.D)](self.grammar, index, grammar_tiles(block))

    def move(self, moves: dict[int, tuple[int, int]]) -> None:
        """Per device d, copy local slot moves[d][0] into moves[d][1]."""
        src = np.zeros((self.D,), np.int32)
        dst = np.zeros((self.D,), np.int32)
        for d, (s, t) in moves.items():
            src[d], dst[d] = s, t
        self.slots = self.executables[("move", self.D)](self.slots, src, dst)


def _abstract(tree, sharding):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), tree)


def placed_weights(cfg: ModelConfig, params: Any, device: Any) -> Any:
    """The weights in the form serving places them on ``device``'s kind: on CPU as bits
    (``pack_weights``: XLA:CPU would widen the bf16 stack); on a TPU with two TensorCores per
    chip (v4, v5p) each layer in buffers of its own (``unstack_weights``: the Mosaic matmul reads
    them in place; 3B decode at W=256 on v5p, estimated 14.2 -> 13.1 ms), made while the loaded
    stack is still held, so startup holds the weights twice there; elsewhere as they are."""
    if device.platform == "cpu":
        return pack_weights(params)
    return unstack_weights(cfg, params) if two_core_tpu(device) else params


def serving_programs(
    lay: SlotLayout, params: Any, slots_per_device: int, prefill_chunk: int, widths: Sequence[int]
) -> list[tuple]:
    """(name, width, fn, abstract args, donated argnums) of every serving executable: prefill,
    score, grammar, insert, move, snapshot and decode at each bucket width. ``params``: the placed (packed)
    weights or their ShapeDtypeStructs; nothing is allocated, so the programs compile for any
    devices, a TPU topology's included (``tools/tpu_check --serve``)."""
    cfg, D = lay.cfg, lay.D
    V, n = cfg.vocab_size, D * slots_per_device
    params = _abstract(params, NamedSharding(lay.mesh, P()))
    prefill = functools.partial(prefill_program, lay)
    rows = lay.slot_sharding()
    state_D = _abstract(jax.eval_shape(lambda: init_state(cfg, D)), rows)
    logits = jax.ShapeDtypeStruct((D, V), jnp.float32, sharding=rows)
    ints = jax.ShapeDtypeStruct((D,), jnp.int32, sharding=rows)
    tokens = jax.ShapeDtypeStruct((D, prefill_chunk), jnp.int32, sharding=rows)
    tpl = lay.row_template()
    req = {k: jax.ShapeDtypeStruct((D, *tpl[k][0]), tpl[k][1], sharding=rows) for k in lay.request_fields()}
    slots = {
        "model": _abstract(jax.eval_shape(lambda: init_state(cfg, n)), rows),
        "rows": {k: jax.ShapeDtypeStruct((n, *shape), dtype, sharding=rows) for k, (shape, dtype, _) in tpl.items()},
    }
    rep = lay.replicated()
    table = jax.ShapeDtypeStruct(grammar_tiles_shape(lay.grammar_rows, V), GRAMMAR_DTYPE, sharding=rep)
    block = jax.ShapeDtypeStruct(grammar_tiles_shape(GRAMMAR_BLOCK, V), GRAMMAR_DTYPE, sharding=rep)
    block_rows = jax.ShapeDtypeStruct((GRAMMAR_BLOCK,), jnp.int32, sharding=rep)
    out = [
        ("prefill", D, prefill, (params, tokens, state_D, ints, logits), ()),
        ("score", D, prefill, (params, tokens, state_D, ints, logits, tokens), ()),
        ("grammar", D, grammar_program, (table, block_rows, block), (0,)),
        ("insert", D, functools.partial(insert_program, lay), (slots, table, state_D, logits, req, ints), (0,)),
        ("move", D, functools.partial(move_program, lay), (slots, ints, ints), (0,)),
        ("snapshot", D, functools.partial(snapshot_program, lay), (slots, ints), ()),
    ]
    steps = jax.ShapeDtypeStruct((), jnp.int32, sharding=rep)
    args = (params, slots, table, steps)
    decode = [("decode", w, functools.partial(decode_program, lay, W=w), args, (1,)) for w in widths]
    return out + decode
