"""On-device sampling with per-row parameters (greedy, temperature, top-k, top-p, min-p, seed),
the penalties that act on the logits before it, and the logprobs reported to clients."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from laplace_jax.platform import skip_unless

Array = jax.Array


CANDIDATES = 1024  # top-k and top-p act on this many most likely tokens per row (at most the vocabulary)
TOP_LOGPROBS = 20  # most likely tokens reported per position (OpenAI's limit)


def token_logprobs(logits_WxV: Array, token_W: Array) -> tuple[Array, Array, Array]:
    """The model's own log-probabilities (log-softmax of the raw logits, before penalties and
    temperature, as vLLM reports by default): (logprob of ``token`` [W], the TOP_LOGPROBS most
    likely ids [W, k] and their logprobs [W, k], k = min(TOP_LOGPROBS, V)). Leading axes may be
    any shape; the vocabulary is the last."""
    lsm = jax.nn.log_softmax(logits_WxV.astype(jnp.float32), axis=-1)
    chosen = jnp.take_along_axis(lsm, token_W[..., None].astype(jnp.int32), axis=-1)[..., 0]
    top_lp, top_ids = jax.lax.top_k(lsm, min(TOP_LOGPROBS, lsm.shape[-1]))
    return chosen, top_ids.astype(jnp.int32), top_lp


def penalize(logits_WxV: Array, rows: dict[str, Array]) -> Array:
    """vLLM's penalties, per row: ``repetition`` divides positive and multiplies negative logits of
    tokens in ``seen`` (the prompt) or ``counts`` (the output so far); ``frequency`` x count and
    ``presence`` x (count > 0) are subtracted; ``bias`` [W, V] is added; while ``count`` (tokens
    generated) is below ``min_tokens`` the tokens of ``stop_mask`` [W, V] (the stop ids) are masked. Neutral
    values (1, 0, 0, zeros, 0) return the logits unchanged, bit for bit."""
    logits = logits_WxV.astype(jnp.float32)
    counts = rows["counts"]
    used = counts > 0
    rep = rows["repetition"][:, None]
    hit = rows["seen"] | used
    logits = jnp.where(hit, jnp.where(logits > 0, logits / rep, logits * rep), logits)
    logits = logits - rows["frequency"][:, None] * counts - rows["presence"][:, None] * used
    logits = logits + rows["bias"]
    early = (rows["count"] < rows["min_tokens"])[:, None]
    return jnp.where(early & rows["stop_mask"], -jnp.inf, logits)


LANES, SUBLANES = 128, 16  # the grammar table's tile: a row is [T, 128], T a multiple of 16 (int16's packed tile)


def grammar_tiles(table_RxV: np.ndarray) -> np.ndarray:
    """A [R, V] next-state table in the device's layout [R, T, LANES] (padded with -1): a row
    gathered per sequence is then whole tiles. By the TPU compiler's estimate this layout adds the
    least to serving's sampler of any tried (benchmarks/results/structured_tpu_layouts.json): a
    [R, V] table's row gather costs 8x more, and [R, ceil(V / 128), 128] gets a whole-table copy
    per call (the compiler lays it out with its middle dimension major)."""
    R, V = table_RxV.shape
    shape = grammar_tiles_shape(R, V)
    padded = np.pad(table_RxV, ((0, 0), (0, shape[1] * LANES - V)), constant_values=-1)
    return padded.reshape(shape)


def grammar_tiles_shape(R: int, V: int) -> tuple[int, int, int]:
    T = -(-V // LANES)
    return R, T + (-T % SUBLANES), LANES


def grammar_row(table_RxTxL: Array, gstate_W: Array, V: int) -> Array:
    """[W, V]: the next state per token of each row's grammar state (a row at -1 reads row 0)."""
    rows = table_RxTxL[jnp.maximum(gstate_W, 0)]
    return rows.reshape(rows.shape[0], -1)[:, :V]


def grammar_limit(pen_WxV: Array, logits_WxV: Array, table_RxTxL: Array, gstate_W: Array) -> Array:
    """Structured outputs' mask (``serve/structured.py``): a row in grammar state ``gstate`` >= 0
    (a row of ``table``, the next state per token, -1 = not allowed; ``grammar_tiles``' layout)
    keeps the penalized logits of the allowed tokens only; a row at -1 is unconstrained and
    unchanged, bit for bit. When the penalties removed every allowed token (``min_tokens`` holding
    back an EOS the grammar requires), the grammar wins: the row falls back to the raw logits of
    the allowed tokens. The table's rows are read only when some row is constrained (a batch
    without one skips the [W, V] gather)."""

    def masked(pen):
        nxt = grammar_row(table_RxTxL, gstate_W, pen.shape[-1])
        allowed = (gstate_W < 0)[:, None] | (nxt >= 0)
        out = jnp.where(allowed, pen, -jnp.inf)
        stuck = ~jnp.any(out > -jnp.inf, axis=-1, keepdims=True)
        return jnp.where(stuck, jnp.where(allowed, logits_WxV.astype(jnp.float32), -jnp.inf), out)

    return jax.lax.cond(jnp.any(gstate_W >= 0), masked, lambda pen: pen, pen_WxV)


def grammar_next(table_RxTxL: Array, gstate_W: Array, token_W: Array, valid_W: Array) -> Array:
    """Each constrained, valid row's state after ``token``; others keep theirs."""
    after = table_RxTxL[jnp.maximum(gstate_W, 0), token_W // LANES, token_W % LANES].astype(gstate_W.dtype)
    return jnp.where((gstate_W >= 0) & valid_W, after, gstate_W)


def count_tokens(counts_WxV: Array, token_W: Array, valid_W: Array) -> Array:
    """Add each row's new token to its output counts (a comparison, not a scatter: Neuron-friendly)."""
    vocab = jnp.arange(counts_WxV.shape[-1], dtype=jnp.int32)
    return counts_WxV + ((vocab[None, :] == token_W[:, None]) & valid_W[:, None]).astype(counts_WxV.dtype)


def sample_rows(
    logits_WxV: Array,
    temperature_W: Array,
    top_k_W: Array,
    top_p_W: Array,
    keys_W: Array,
    min_p_W: Array | None = None,
) -> Array:
    """One token per row. temperature <= 0: argmax; top_k 0: off; top_p 1: off; min_p 0: off
    (min_p keeps tokens whose probability is at least min_p x the most likely one's). keys:
    typed PRNG keys [W].

    No sort of the vocabulary (Neuron supports only plain comparators, and a sort of every row
    cost 9% of a 3B decode step's bytes): ``lax.top_k`` takes the ``CANDIDATES`` most likely
    tokens, whose k-th value and whose top-p cutoff (mass from the full softmax) give a logit
    threshold, and the draw is over every token at or above it. Rows with neither limit draw
    from the whole vocabulary. Exact whenever top_k <= CANDIDATES (the server checks) and the
    candidates hold at least top_p of the mass; a nucleus wider than that is cut at CANDIDATES.
    """
    logits = logits_WxV.astype(jnp.float32)
    greedy = jnp.argmax(logits, axis=-1)
    row_max = jnp.max(logits, axis=-1, keepdims=True)  # beside the argmax: one pass over the logits

    def draw(logits):
        masked = limit_logits(logits, temperature_W, top_k_W, top_p_W, min_p_W, row_max_W=row_max)
        return jax.vmap(lambda key, row: jax.random.categorical(key, row))(keys_W, masked).astype(greedy.dtype)

    drawn = skip_unless(jnp.any(temperature_W > 0), draw, lambda _: greedy, logits)  # all greedy: no draw
    return jnp.where(temperature_W <= 0, greedy, drawn).astype(jnp.int32)


def limit_logits(
    logits_WxV: Array,
    temperature_W: Array,
    top_k_W: Array,
    top_p_W: Array,
    min_p_W: Array | None = None,
    row_max_W: Array | None = None,
) -> Array:
    """The logits ``sample_rows`` draws from (sampled rows): divided by the temperature, -inf
    outside the top-k / top-p / min-p limits; their softmax is the distribution of its draw. Each
    limit's work runs only when some row sets it: the candidates' top-k (a sort of every row on
    some backends) for top-k and top-p, in a branch that takes the raw logits and divides them
    itself (so the division fuses into what reads it there); min-p needs each row's maximum
    (``row_max_W``: [W, 1], the raw logits' own, where the caller already has it)."""
    logits = logits_WxV.astype(jnp.float32)
    t = jnp.maximum(temperature_W, 1e-6)[:, None]
    scaled = logits / t
    none = lambda logits: jnp.full((logits.shape[0], 1), -jnp.inf, logits.dtype)  # noqa: E731
    limited = (top_k_W > 0) | (top_p_W < 1.0)
    threshold = skip_unless(jnp.any(limited), lambda x: _top_cutoff(x / t, top_k_W, top_p_W, limited), none, logits)
    if min_p_W is not None:  # p_i >= min_p * p_max  <=>  scaled_i >= scaled_max + log(min_p)
        row_max = jnp.max(logits, axis=-1, keepdims=True) if row_max_W is None else row_max_W
        top = row_max / t  # = max(scaled): x / t rounds monotonically in x
        threshold = jnp.maximum(threshold, top + jnp.log(min_p_W)[:, None])
    return jnp.where(scaled >= threshold, scaled, -jnp.inf)


def _top_cutoff(scaled_WxV: Array, top_k_W: Array, top_p_W: Array, limited_W: Array) -> Array:
    """[W, 1]: each row's smallest logit inside its top-k and top-p (-inf for a row with neither:
    ``limited`` false)."""
    top, _ = jax.lax.top_k(scaled_WxV, min(CANDIDATES, scaled_WxV.shape[-1]))  # [W, K] descending
    k = jnp.where(top_k_W > 0, jnp.minimum(top_k_W, top.shape[-1]), top.shape[-1])
    kth = jnp.take_along_axis(top, (k - 1)[:, None], axis=-1)  # k-th largest
    probs = jnp.exp(top - jax.nn.logsumexp(scaled_WxV, axis=-1, keepdims=True))
    before = jnp.cumsum(probs, axis=-1) - probs  # mass strictly above each candidate
    cutoff = jnp.min(jnp.where(before < top_p_W[:, None], top, jnp.inf), axis=-1, keepdims=True)  # smallest kept
    return jnp.where(limited_W[:, None], jnp.maximum(kth, cutoff), -jnp.inf)


def speculative_accept(
    logits_WxNxV: Array,
    draft_WxK: Array,
    temperature_W: Array,
    top_k_W: Array,
    top_p_W: Array,
    keys_W: Array,
    min_p_W: Array | None = None,
) -> tuple[Array, Array]:
    """Speculative sampling for a draft that proposes one token per position (an n-gram lookup:
    all its mass on that token). ``logits`` at N = K + 1 positions, position j's given the context
    and ``draft[:, :j]``; a draft id < 0 is padding (a shorter proposal) and is never accepted.

    Returns (tokens [W, N], accepted [W]): a row emits ``tokens[:accepted + 1]``, its accepted
    draft followed by one token of its own. Greedy rows (temperature <= 0) accept while the draft
    equals the argmax and then emit the argmax. Sampled rows accept draft token d with probability
    p(d) under ``limit_logits``' distribution p, and at the first rejection draw from p with d
    removed (renormalized; with every token accepted, from the last position's p): the standard
    rule, so the emitted tokens are distributed exactly as ``sample_rows`` one position at a time.
    """
    W, N, V = logits_WxNxV.shape
    rep = lambda x: None if x is None else jnp.repeat(x, N, axis=0)  # noqa: E731
    masked = limit_logits(logits_WxNxV.reshape(W * N, V), rep(temperature_W), rep(top_k_W), rep(top_p_W), rep(min_p_W))
    masked = masked.reshape(W, N, V)
    draft = _padded(draft_WxK)
    keys = jax.vmap(lambda key: jax.random.split(key, 2 * N).reshape(2, N))(keys_W)  # [W, 2, N]: accept, draw
    lsm = jax.nn.log_softmax(masked, axis=-1)
    p_draft = jnp.exp(jnp.take_along_axis(lsm, jnp.maximum(draft, 0)[..., None], axis=-1)[..., 0])
    u = jax.vmap(jax.vmap(lambda key: jax.random.uniform(key)))(keys[:, 0])
    greedy_W = temperature_W <= 0
    argmax = jnp.argmax(logits_WxNxV, axis=-1).astype(jnp.int32)
    residual = jnp.where(jnp.arange(V) == draft[..., None], -jnp.inf, masked)  # p without the rejected token
    drawn = jax.vmap(jax.vmap(jax.random.categorical))(keys[:, 1], residual).astype(jnp.int32)
    ok = jnp.where(greedy_W[:, None], draft == argmax, (draft >= 0) & (u < p_draft))
    return _keep_prefix(draft, ok, jnp.where(greedy_W[:, None], argmax, drawn))


def greedy_accept(logits_WxNxV: Array, draft_WxK: Array) -> tuple[Array, Array]:
    """``speculative_accept`` when every row decodes greedily: the same tokens and counts, with no
    draws (the draft is kept while it equals the argmax, then the argmax)."""
    draft = _padded(draft_WxK)
    argmax = jnp.argmax(logits_WxNxV, axis=-1).astype(jnp.int32)
    return _keep_prefix(draft, draft == argmax, argmax)


def _padded(draft_WxK: Array) -> Array:
    """[W, K + 1]: the draft and a -1 after it (no draft after the last position)."""
    return jnp.concatenate([draft_WxK, jnp.full((draft_WxK.shape[0], 1), -1, draft_WxK.dtype)], axis=1)


def _keep_prefix(draft_WxN: Array, ok_WxN: Array, own_WxN: Array) -> tuple[Array, Array]:
    """The draft while every position so far was accepted, then the row's own token: (tokens, accepted)."""
    accepted = jnp.sum(jnp.cumprod(ok_WxN[:, :-1], axis=1), axis=1).astype(jnp.int32)
    return jnp.where(jnp.arange(draft_WxN.shape[1]) < accepted[:, None], draft_WxN, own_WxN), accepted
