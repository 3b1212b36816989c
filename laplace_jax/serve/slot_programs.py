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
            its host grammar's next mask) skips the model. With speculation (``NgramSpec``) each
            step is one verify: K draft tokens per row from an n-gram lookup in the row's own
            history, K + 1 tokens through the model, the accepted prefix plus one token emitted
            (1 .. K + 1 per row per step), and the state rolled forward over what was emitted from
            the verify's trace (``models.gla_lm.commit``: no second read of the weights)
  move      per device, copy local slot src_d into dst_d (compaction; src_d == dst_d: nothing)
  snapshot  per device, a copy of local slot i_d's model state (the prefix cache's end entries)

A finished row's state stays as it was after its last fed token (decode treats a done row's
token as padding, which leaves its state bit for bit), so a snapshot is the state after the
prompt and the generated tokens fed back. Every program works on the per-device view
[D, S, ..] of the slot axis, so no data crosses devices.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from laplace_jax.config import ModelConfig
from laplace_jax.layers.common import VERIFY_INPUTS
from laplace_jax.models.gla_lm import commit, decode_step, prefill, verify
from laplace_jax.platform import key_words, skip_unless
from laplace_jax.sampling import (
    adjusted,
    count_tokens,
    grammar_limit,
    grammar_next,
    grammar_row,
    greedy_accept,
    penalize,
    penalized,
    sample_rows,
    speculative_accept,
    token_logprobs,
)
from laplace_jax.serve.structured import HELD
from laplace_jax.speculative import NgramSpec, backoff, ngram_proposal


def row_template(prng: str, vocab_size: int, history: int = 0) -> dict[str, tuple[tuple[int, ...], Any, Any]]:
    """Per-slot sampling fields: name -> (shape, dtype, idle value); ``prng``: the keys' implementation.

    The vocabulary-wide rows (``bias``, ``seen``, ``stop_mask``, ``counts``) hold the penalties'
    inputs: 10 bytes per token id per slot (0.5 MB per slot for the 3B model's 50,304 ids, 1.7% of
    its 29.5 MB state); a plain step keeps ``counts`` for the rows with a presence, frequency or
    repetition penalty only (the others never read theirs). ``history`` > 0 (speculation): the
    row's tokens so far (prompt and output, ``hlen`` of them; the n-gram lookup's text) in a
    buffer of that many ids, and the lookup's back-off counters (``speculative.backoff``)."""
    spec = {
        "history": ((history,), jnp.int32, -1),
        "hlen": ((), jnp.int32, 0),
        "skip": ((), jnp.int32, 0),
        "pause": ((), jnp.int32, 1),
    }
    return (spec if history else {}) | {
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
        "biased": ((), jnp.bool_, False),  # some entry of ``bias`` is not 0 (the penalties' work runs)
        "seen": ((vocab_size,), jnp.bool_, False),
        "stop_mask": ((vocab_size,), jnp.bool_, False),
        "counts": ((vocab_size,), jnp.int32, 0),
        "done": ((), jnp.bool_, True),
        "gstate": ((), jnp.int32, -1),  # the row's structured-output state (a grammar table row), -1: none
        "logprobs": ((), jnp.bool_, False),  # the request reads its tokens' logprobs (``Request.wants_logprobs``)
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
    "biased",
    "seen",
    "stop_mask",
    "gstate",
    "logprobs",
    "history",  # speculation only (``row_template``)
    "hlen",
)
VERIFY_IMPL = "recurrent"  # the GLA kernel of a verify's K + 1 tokens (the chunk kernel pads them to a chunk)
VERIFY_KEEP = VERIFY_INPUTS  # a verify's trace for the rollback (``models.gla_lm.verify``)
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
    speculation: NgramSpec | None = None
    max_model_len: int = 0  # tokens a row's history holds (with speculation)
    jump_forward: int = 0  # without speculation: the forced tokens a verify feeds (``ServeConfig.jump_forward``)

    @property
    def D(self) -> int:
        return self.mesh.size

    @property
    def draft_tokens(self) -> int:
        """K, the draft tokens a decode step verifies per row: n-gram speculation's, else
        ``jump_forward`` (a structured output's forced tokens only); 0: no verify."""
        return self.jump_forward if self.speculation is None else self.speculation.num_speculative_tokens

    @property
    def positions(self) -> int:
        """Tokens a decode step can emit per row: K + 1 with drafts, else 1."""
        return self.draft_tokens + 1

    @property
    def history(self) -> int:
        """The history buffer's length (0: none): room for a whole sequence and one verify's writes."""
        return 0 if self.speculation is None else self.max_model_len + self.positions

    def row_template(self) -> dict[str, tuple[tuple[int, ...], Any, Any]]:
        return row_template(self.prng, self.cfg.vocab_size, self.history)

    def request_fields(self) -> tuple[str, ...]:
        tpl = self.row_template()
        return tuple(k for k in REQUEST_FIELDS if k in tpl)

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
    if lay.speculation is not None:  # the first token joins the row's history
        history = jax.vmap(lambda h, n, t: h.at[n].set(t))(req_D["history"], req_D["hlen"], first)
        ones = jnp.ones((D,), jnp.int32)
        new_rows |= dict(history=history, hlen=req_D["hlen"] + 1, skip=0 * ones, pause=ones)
    rows = {k: put_all(slots["rows"][k], new_rows[k]) for k in slots["rows"]}
    return lay.constrain({"model": model, "rows": rows}), first, token_logprobs(logits_DxV, first)


def decode_program(lay: SlotLayout, params, slots, grammar_RxTxL, steps, W: int):
    """``steps`` (a device scalar, 1 .. ``steps_per_call``: the later steps skip the model and emit
    nothing) for the first W local slots of every device: the slots after them,
    and per emitted position (``steps x positions`` of them, [.., D, W]) the tokens, whether each
    is real, and their logprobs; and the speculation counters [3] (drafts, draft tokens,
    accepted tokens; zeros without speculation)."""
    D, N = lay.D, lay.positions

    def take(x):  # the first W local slots of every device, flattened to D*W rows
        return _join(jax.lax.slice_in_dim(_split(x, D), 0, W, axis=1))

    def give(x, sub):
        return _join(jax.lax.dynamic_update_slice_in_dim(_split(x, D), _split(sub, D), 0, 1))

    def step(sub, i):
        r = sub["rows"]
        # a done row keeps its final state (the prefix cache's end entry); a row whose host grammar
        # has not written its next mask yet (its table row all HELD) waits, state and all
        held = (r["gstate"] >= 0) & _waiting(grammar_RxTxL, r["gstate"])
        valid = ~r["done"] & ~held & (i < steps)
        plain = functools.partial(_plain_step, lay, params, grammar_RxTxL, valid=valid)
        if lay.positions == 1:
            return jax.lax.cond(jnp.any(valid), plain, functools.partial(_idle_step, lay, plain), sub)
        if lay.speculation is None:  # jump-forward alone: no look-ups
            ngram, looked = jnp.full((valid.shape[0], lay.draft_tokens), -1, jnp.int32), jnp.zeros_like(valid)
        else:
            ngram, looked = _proposals(lay.speculation, r, valid)
        # a constrained row drafts its grammar's forced tokens, any other its n-gram look-up's
        draft = jnp.where((r["gstate"] >= 0)[:, None], _forced(lay, grammar_RxTxL, r, valid), ngram)
        verify = functools.partial(_verify_step, lay, params, grammar_RxTxL, valid=valid, draft=draft, looked=looked)
        spec_plain = functools.partial(_spec_plain_step, lay, plain, looked=looked)
        idle = functools.partial(_idle_step, lay, verify)
        branch = jnp.where(jnp.any(valid), jnp.where(jnp.any(draft >= 0), 2, 1), 0)  # one switch, not nested conds
        if lay.speculation is None:
            return jax.lax.switch(branch, (idle, spec_plain, verify), sub)
        # the history stays out of the switch (on XLA:CPU each branch carrying it cost a copy);
        # the emitted tokens join it after
        history = {k: r[k] for k in ("history", "hlen")}
        inner = dict(sub, rows={k: v for k, v in r.items() if k not in history})
        sub, out = jax.lax.switch(branch, (idle, spec_plain, verify), inner)
        rows = _record(sub["rows"] | history, out[0], jnp.sum(out[1], axis=1, dtype=jnp.int32))
        return dict(sub, rows=rows), out

    sub, (toks, valid, lps, stats) = jax.lax.scan(
        step, lay.constrain(jax.tree.map(take, slots)), jnp.arange(lay.steps_per_call)
    )
    K = lay.steps_per_call * N  # [steps, D*W, N, ..] -> [steps * N, D, W, ..]: emitted in order
    toks, valid, lps = jax.tree.map(lambda x: _positions(x, K, D, W), (toks, valid, lps))
    return lay.constrain(jax.tree.map(give, slots, sub)), toks, valid, lps, jnp.sum(stats, axis=0)


def _positions(x: jax.Array, K: int, D: int, W: int) -> jax.Array:
    return jnp.moveaxis(x, 2, 1).reshape(K, D, W, *x.shape[3:])


def _plain_step(lay: SlotLayout, params, grammar_RxTxL, sub, *, valid):
    """One token for every valid row: (slots, (tokens, valid, logprobs, stats)), per position [D*W, 1]."""
    r = sub["rows"]
    logits, model = decode_step(lay.cfg, params, r["token"], sub["model"], valid)
    tok = jnp.where(valid, _sample(lay, grammar_RxTxL, logits, r, valid), r["token"])
    gstate = grammar_next(grammar_RxTxL, r["gstate"], tok, valid)
    remaining = r["remaining"] - valid
    stop = jnp.take_along_axis(r["stop_mask"], tok[:, None], axis=-1)[:, 0]
    done = r["done"] | (valid & (stop | (remaining <= 0)))
    counted = valid & penalized(r)  # only penalized rows read their counts (``penalize``)
    counts = skip_unless(jnp.any(counted), count_tokens, lambda c, *_: c, r["counts"], tok, counted)
    count = r["count"] + valid  # a row's tokens (min_tokens, its sampling key): a waiting row's stays
    rows = dict(r, token=tok, count=count, remaining=remaining, done=done, counts=counts, gstate=gstate)
    out = (tok, valid, _logprobs(logits, tok, valid & r["logprobs"]), jnp.zeros((3,), jnp.int32))
    return lay.constrain({"model": model, "rows": rows}), jax.tree.map(lambda x: x[:, None], out[:3]) + out[3:]


def _idle_step(lay: SlotLayout, live, sub):
    """Every row done or waiting for the host: the step skips the model (the outputs of ``live``'s
    shapes, nothing valid)."""
    r = sub["rows"]
    shapes = jax.eval_shape(live, sub)[1]
    outs = jax.tree.map(_zeros, shapes)
    rows = dict(r)
    if lay.speculation is not None:
        rows["skip"] = jnp.maximum(r["skip"] - 1, 0)
    tok = jnp.broadcast_to(r["token"][:, None], outs[0].shape)
    return lay.constrain({"model": sub["model"], "rows": rows}), (tok, *outs[1:])


def _proposals(spec: NgramSpec, r: dict, valid_W: jax.Array) -> tuple[jax.Array, jax.Array]:
    """[W, K] draft ids per row (-1: none), and [W] whether each row looked. A row proposes only
    while it samples from its own logits alone: no penalties (their counts would change within the
    draft) and no grammar (its state would); only as many as its ``remaining`` tokens allow; and
    not while its look-ups are paused (``speculative.backoff``)."""
    K = spec.num_speculative_tokens
    plain = ~penalized(r) & (r["gstate"] < 0)
    on = valid_W & plain & (r["skip"] == 0) & (r["remaining"] > 1)

    def look(history_WxL, hlen_W):
        lookup = functools.partial(ngram_proposal, k=K, n_min=spec.prompt_lookup_min, n_max=spec.prompt_lookup_max)
        return jax.vmap(lookup)(history_WxL, hlen_W)

    none = lambda h, n: jnp.full((h.shape[0], K), -1, h.dtype)  # noqa: E731  every row paused: no look-up
    draft = skip_unless(jnp.any(on), look, none, r["history"], r["hlen"])
    return jnp.where(on[:, None] & (jnp.arange(K)[None] < r["remaining"][:, None] - 1), draft, -1), on


def _waiting(grammar_RxTxL, g_W: jax.Array) -> jax.Array:
    """[W] whether table row ``g`` is a host grammar's waiting row (all ``HELD``)."""
    return grammar_RxTxL[jnp.maximum(g_W, 0), 0, 0] == HELD


def _sample(lay: SlotLayout, grammar_RxTxL, logits_WxV: jax.Array, r: dict, valid_W: jax.Array) -> jax.Array:
    """[W] each row's token from its logits, penalized (``penalize``) and masked by its grammar
    (``grammar_limit``) only when some valid row has a penalty, a logit bias, stop tokens still
    held back (``min_tokens``) or a grammar: both leave every other row's logits as they are, bit
    for bit. The sampler sits inside both branches: a branch that passed the logits through
    unchanged would copy them (the logprobs read them after), 0.056 ms per token of the 3B
    decode at 256 rows on the TPU compiler's estimate, where the penalties' pass is 0.12 ms."""
    keys = functools.partial(row_keys, lay.prng, r)  # made only where some row draws
    pick = lambda x: sample_rows(x, r["temperature"], r["top_k"], r["top_p"], keys, r["min_p"])  # noqa: E731

    def limited(x):
        return pick(grammar_limit(penalize(x, r), x, grammar_RxTxL, r["gstate"]))

    some = jnp.any(valid_W & (adjusted(r) | (r["gstate"] >= 0)))
    return skip_unless(some, limited, pick, logits_WxV)


def row_keys(prng: str, rows: dict) -> jax.Array:
    """[W] typed keys, each row's next token's: its request's key folded in with its token count."""
    return jax.vmap(jax.random.fold_in)(jax.random.wrap_key_data(rows["key"], impl=prng), rows["count"])


def _forced(lay: SlotLayout, grammar_RxTxL, r: dict, valid_W: jax.Array) -> jax.Array:
    """[W, K] the tokens each constrained row's grammar forces next (jump-forward in the middle of
    an output: a JSON key, a closing brace), -1 after: from the row's state, while a state allows
    exactly one token and the state after it is the device's own (not a host grammar's waiting
    row), at most ``remaining`` - 1 (the verify emits one token more). Each is the only token the
    row's mask lets it sample, so the verify accepts them all: the output is the one-token-per-step
    output, bit for bit. The table's rows are read only when some valid row is constrained."""
    K, V = lay.draft_tokens, lay.cfg.vocab_size

    def chain(g_W):
        on, toks = valid_W & (g_W >= 0), []
        for t in range(K):
            nxt = grammar_row(grammar_RxTxL, g_W, V)
            allowed = nxt >= 0
            tok = jnp.argmax(allowed, axis=-1).astype(jnp.int32)
            after = jnp.take_along_axis(nxt, tok[:, None], axis=-1)[:, 0].astype(jnp.int32)
            held = _waiting(grammar_RxTxL, after)
            on = on & (jnp.sum(allowed, axis=-1) == 1) & ~held & (t < r["remaining"] - 1)
            toks.append(jnp.where(on, tok, -1))
            g_W = jnp.where(on, after, g_W)
        return jnp.stack(toks, axis=1)

    none = lambda g_W: jnp.full((g_W.shape[0], K), -1, jnp.int32)  # noqa: E731
    return skip_unless(jnp.any(valid_W & (r["gstate"] >= 0)), chain, none, r["gstate"])


def _spec_plain_step(lay: SlotLayout, plain, sub, *, looked):
    """No row has a draft: one plain step (a row that looked found nothing, and backs off); the
    outputs padded to K + 1 positions (only the first is real)."""
    sub, (tok, valid, lps, stats) = plain(sub)
    r = sub["rows"]
    rows = dict(r)
    if lay.speculation is not None:
        none = jnp.zeros_like(looked)
        rows["skip"], rows["pause"] = backoff(r["skip"], r["pause"], looked, none, none.astype(jnp.int32))
    pad = lambda x: jnp.pad(x, [(0, 0), (0, lay.positions - 1)] + [(0, 0)] * (x.ndim - 2))  # noqa: E731
    return dict(sub, rows=rows), (*jax.tree.map(pad, (tok, valid, lps)), stats)


def _record(rows: dict, toks_WxN: jax.Array, emitted_W: jax.Array) -> dict:
    """Each row's history with its first ``emitted`` tokens appended."""
    history = jax.vmap(lambda h, n, t: jax.lax.dynamic_update_slice(h, t, (n,)))(
        rows["history"], rows["hlen"], toks_WxN.astype(jnp.int32)
    )
    return dict(rows, history=history, hlen=rows["hlen"] + emitted_W)


def _verify_step(lay: SlotLayout, params, grammar_RxTxL, sub, *, valid, draft, looked):
    """One verify for every valid row: [token, draft] (K + 1 ids) through the model, the draft's
    accepted prefix and one token of the row's own emitted (``sampling.speculative_accept``; a row
    without a draft samples its one token exactly as a plain step does), cut at a stop token, and
    the state committed over the emitted tokens from the verify's trace. A constrained row's draft
    is its forced tokens (``_forced``): position t is masked by the grammar state after the draft's
    first t tokens. A row with penalties drafts only forced tokens and emits only them (its own
    token's penalties would miss their counts: it is sampled at the next step)."""
    r = sub["rows"]
    N = lay.positions
    vcfg = dataclasses.replace(lay.cfg, attn_impl=VERIFY_IMPL)
    fed = jnp.concatenate([r["token"][:, None], jnp.maximum(draft, 0)], axis=1)  # [W, N]
    logits, trace = verify(vcfg, params, fed, sub["model"], valid, VERIFY_KEEP)  # [W, N, V]
    gstates = [r["gstate"]]  # the grammar state at each position, along the draft
    for t in range(N - 1):
        gstates.append(grammar_next(grammar_RxTxL, gstates[-1], jnp.maximum(draft[:, t], 0), draft[:, t] >= 0))

    def limit(t):  # position t: t tokens after the row's count (min_tokens); a loop, so the mask's cond stays one
        pen = penalize(logits[:, t], dict(r, count=r["count"] + t))
        return grammar_limit(pen, logits[:, t], grammar_RxTxL, gstates[t])

    limited = jnp.stack([limit(t) for t in range(N)], axis=1)
    sampling = (r["temperature"], r["top_k"], r["top_p"])

    def sampled():  # some row samples: the rejection rule, and a row without a draft draws as a plain step
        keys = row_keys(lay.prng, r)
        toks, accepted = speculative_accept(limited, draft, *sampling, keys, r["min_p"])
        own = sample_rows(limited[:, 0], *sampling, keys, r["min_p"])
        return toks.at[:, 0].set(jnp.where(draft[:, 0] < 0, own, toks[:, 0])), accepted

    greedy = functools.partial(greedy_accept, limited, draft)  # every row greedy: no draws (the same tokens)
    toks, accepted = skip_unless(jnp.any(valid & (r["temperature"] > 0)), sampled, greedy)
    pos = jnp.arange(N)[None]
    stop_WxN = jnp.take_along_axis(r["stop_mask"], toks, axis=-1)
    first_stop = jnp.min(jnp.where(stop_WxN, pos, N), axis=-1)
    emitted = jnp.where(valid, jnp.minimum(accepted + 1, first_stop + 1), 0)  # <= remaining (the drafts' bound)
    with_counts = penalized(r)
    proposed = draft[:, 0] >= 0
    emitted = jnp.where(with_counts & proposed, jnp.minimum(emitted, jnp.maximum(accepted, 1)), emitted)
    model = commit(vcfg, sub["model"], trace, emitted)  # the state after the emitted tokens, no weights read
    fresh = emitted > 0
    last = jnp.take_along_axis(toks, jnp.maximum(emitted - 1, 0)[:, None], axis=-1)[:, 0]
    remaining = r["remaining"] - emitted
    done = r["done"] | (valid & ((first_stop < emitted) | (remaining <= 0)))
    gstate = r["gstate"]
    for t in range(N):
        gstate = grammar_next(grammar_RxTxL, gstate, toks[:, t], t < emitted)

    def counted(n):  # the output counts over the first n positions (only penalized rows read them)
        out = r["counts"]
        for t in range(n):
            out = count_tokens(out, toks[:, t], t < emitted)
        return out

    several = jnp.any(with_counts & proposed & (emitted > 1))  # else one token per row counts
    counts = jax.lax.cond(several, lambda: counted(N), lambda: counted(1))
    rows = dict(
        r,
        token=jnp.where(fresh, last, r["token"]),
        count=r["count"] + emitted,
        remaining=remaining,
        done=done,
        counts=counts,
        gstate=gstate,
    )
    spec = proposed & valid & (r["gstate"] < 0)  # n-gram drafts (the speculation counters; forced drafts are not)
    if lay.speculation is not None:
        rows["skip"], rows["pause"] = backoff(r["skip"], r["pause"], looked, proposed & (r["gstate"] < 0), accepted)
    stats = jnp.stack([jnp.sum(spec), jnp.sum((draft >= 0) & spec[:, None]), jnp.sum(jnp.where(spec, accepted, 0))])
    out = (toks, pos < emitted[:, None], _logprobs(logits, toks, valid & r["logprobs"]), stats.astype(jnp.int32))
    return lay.constrain({"model": model, "rows": rows}), out


def _logprobs(logits: jax.Array, toks: jax.Array, wanted_W: jax.Array) -> tuple[jax.Array, ...]:
    """``token_logprobs`` when some valid row reads them, else zeros (never read: the host reads a
    call's logprobs only for requests that want them), so the vocabulary's top-k is skipped."""
    none = lambda logits, toks: jax.tree.map(_zeros, jax.eval_shape(token_logprobs, logits, toks))  # noqa: E731
    return skip_unless(jnp.any(wanted_W), token_logprobs, none, logits, toks)


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
