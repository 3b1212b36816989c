"""On-device sampling with per-row parameters (greedy, temperature, top-k, top-p, min-p, seed),
the penalties that act on the logits before it, and the logprobs reported to clients."""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from laplace_jax.platform import per_platform, skip_unless

Array = jax.Array


CANDIDATES = 1024  # top-k and top-p act on this many most likely tokens per row (at most the vocabulary)
TOP_LOGPROBS = 20  # most likely tokens reported per position (OpenAI's limit)
TOP_K_PIECE = 512  # the largest top-k the TPU compiler runs as its TopK call: above it, it sorts every row
DRAW_BLOCK = 128  # a draw picks a block of this many tokens by the block's mass, then a token in it
ROW_GROUP = 8  # rows per tile of an fp32 array on TPU


def token_logprobs(logits_WxV: Array, token_W: Array) -> tuple[Array, Array, Array]:
    """The model's own log-probabilities (log-softmax of the raw logits, before penalties and
    temperature, as vLLM reports by default): (logprob of ``token`` [W], the TOP_LOGPROBS most
    likely ids [W, k] and their logprobs [W, k], k = min(TOP_LOGPROBS, V)). Leading axes may be
    any shape; the vocabulary is the last. ``jax.nn.log_softmax``'s arithmetic, applied to the
    values read only (the top-k takes the raw logits: the [W, V] log-softmax is never written),
    and the row's maximum is the top-k's first (no pass over the row of its own)."""
    logits = logits_WxV.astype(jnp.float32)
    top, top_ids = jax.lax.top_k(logits, min(TOP_LOGPROBS, logits.shape[-1]))
    row_max = jnp.max(top, axis=-1, keepdims=True)  # = top[..., :1] (a slice of top_k's result makes the TPU sort)
    log_sum = jnp.log(jnp.sum(jnp.exp(logits - row_max), axis=-1, keepdims=True))
    logprob = lambda x: (x - row_max) - log_sum  # noqa: E731
    chosen = jnp.take_along_axis(logits, token_W[..., None].astype(jnp.int32), axis=-1)
    return logprob(chosen)[..., 0], top_ids.astype(jnp.int32), logprob(top)


def penalized(rows: dict[str, Array]) -> Array:
    """[W] whether a row samples with a presence, frequency or repetition penalty (the ones that
    read its ``counts``)."""
    return (rows["presence"] != 0) | (rows["frequency"] != 0) | (rows["repetition"] != 1)


def adjusted(rows: dict[str, Array]) -> Array:
    """[W] whether ``penalize`` can change a row's logits: a penalty (``penalized``), a logit bias
    (``biased``: some entry of ``bias`` is not 0) or stop tokens still held back (``count`` below
    ``min_tokens``). Every other row's logits it returns bit for bit."""
    return penalized(rows) | rows["biased"] | (rows["count"] < rows["min_tokens"])


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

    return skip_unless(jnp.any(gstate_W >= 0), masked, lambda pen: pen, pen_WxV)


def grammar_next(table_RxTxL: Array, gstate_W: Array, token_W: Array, valid_W: Array) -> Array:
    """Each constrained, valid row's state after ``token``; others keep theirs."""
    after = table_RxTxL[jnp.maximum(gstate_W, 0), token_W // LANES, token_W % LANES].astype(gstate_W.dtype)
    return jnp.where((gstate_W >= 0) & valid_W, after, gstate_W)


def count_tokens(counts_WxV: Array, token_W: Array, valid_W: Array) -> Array:
    """Add each valid row's new token to its output counts: in a program for TPU a scatter of one
    entry per row into the counts in place (a comparison over the vocabulary reads and writes all
    of them, 0.054 ms per 3B token at 256 rows by the TPU compiler's estimate), elsewhere that
    comparison (Neuron-friendly: no scatter)."""

    def compared(counts, token, valid):
        vocab = jnp.arange(counts.shape[-1], dtype=jnp.int32)
        return counts + ((vocab[None, :] == token[:, None]) & valid[:, None]).astype(counts.dtype)

    def scattered(counts, token, valid):
        return counts.at[jnp.arange(counts.shape[0]), token].add(valid.astype(counts.dtype))

    return per_platform(counts_WxV, token_W, valid_W, default=compared, tpu=scattered)


def sample_rows(
    logits_WxV: Array,
    temperature_W: Array,
    top_k_W: Array,
    top_p_W: Array,
    keys_W: Array | Callable[[], Array],
    min_p_W: Array | None = None,
) -> Array:
    """One token per row. temperature <= 0: argmax; top_k 0: off; top_p 1: off; min_p 0: off
    (min_p keeps tokens whose probability is at least min_p x the most likely one's). keys:
    typed PRNG keys [W], or a function that makes them (called only where some row draws, so a
    batch of greedy rows does not pay for its keys).

    No sort of the vocabulary (Neuron supports only plain comparators, and a sort of every row
    cost 9% of a 3B decode step's bytes): ``top_values`` takes the ``CANDIDATES`` largest logits,
    whose k-th value and whose top-p cutoff (mass from the full softmax) give a logit threshold,
    and the draw (``draw``: a block by its mass, then a token in it) is over every token at or
    above it. Rows with neither limit draw from the whole vocabulary. Exact whenever top_k <=
    CANDIDATES (the server checks) and the candidates hold at least top_p of the mass; a nucleus
    wider than that is cut at CANDIDATES.
    """
    logits = logits_WxV.astype(jnp.float32)
    greedy = jnp.argmax(logits, axis=-1)
    row_max = jnp.max(logits, axis=-1, keepdims=True)  # beside the argmax: one pass over the logits

    def sampled(logits):
        t, threshold = _limits(logits, temperature_W, top_k_W, top_p_W, min_p_W, row_max)
        limit = lambda x: _limited(x, t, threshold)  # noqa: E731
        keys = keys_W() if callable(keys_W) else keys_W
        return draw(keys, logits, row_max / t, limit).astype(greedy.dtype)  # row_max / t: the limited max

    drawn = skip_unless(jnp.any(temperature_W > 0), sampled, lambda _: greedy, logits)  # all greedy: no draw
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
    limit's work runs only when some row sets it: the candidates' top values (``top_values``) for
    top-k and top-p, in a branch that takes the raw logits and divides them
    itself (so the division fuses into what reads it there); min-p needs each row's maximum
    (``row_max_W``: [W, 1], the raw logits' own, where the caller already has it)."""
    logits = logits_WxV.astype(jnp.float32)
    return _limited(logits, *_limits(logits, temperature_W, top_k_W, top_p_W, min_p_W, row_max_W))


def _limits(logits_WxV, temperature_W, top_k_W, top_p_W, min_p_W, row_max_W) -> tuple[Array, Array]:
    """``limit_logits``' divisor and logit threshold per row, each [W, 1]."""
    t = _temperature(temperature_W)
    none = lambda logits: jnp.full((logits.shape[0], 1), -jnp.inf, logits.dtype)  # noqa: E731
    limited = (top_k_W > 0) | (top_p_W < 1.0)
    top = None if row_max_W is None else row_max_W / t  # = max(scaled): x / t rounds monotonically in x
    top_cutoff = lambda x: _top_cutoff(x / t, top_k_W, top_p_W, limited, top)  # noqa: E731
    threshold = skip_unless(jnp.any(limited), top_cutoff, none, logits_WxV)
    if min_p_W is not None:  # p_i >= min_p * p_max  <=>  scaled_i >= scaled_max + log(min_p)
        top = jnp.max(logits_WxV, axis=-1, keepdims=True) / t if top is None else top
        threshold = jnp.maximum(threshold, top + jnp.log(min_p_W)[:, None])
    return t, threshold


def _limited(logits: Array, t_W: Array, threshold_W: Array) -> Array:
    """Logits [W, ...] divided by t, -inf below the threshold (both [W, 1])."""
    scaled = logits / t_W
    return jnp.where(scaled >= threshold_W, scaled, -jnp.inf)


def _temperature(temperature_W: Array) -> Array:
    """[W, 1]: what ``limit_logits`` divides each row by (a greedy row's 0 as 1e-6)."""
    return jnp.maximum(temperature_W, 1e-6)[:, None]


def draw(keys_W: Array, logits_WxV: Array, shift_W: Array, limit: Callable[[Array], Array] | None = None) -> Array:
    """One token per row of softmax(limit(logits)) (-inf: never drawn; ``limit``: an elementwise
    map with per-row [W, 1] parameters, none by default), ``shift`` [W, 1] the limited row's
    maximum (exp(x - shift) must neither overflow nor underflow for the likeliest token).

    With threefry keys (JAX's default, every backend's here but Neuron's), whose bits cost a
    counter hash each: a block of ``DRAW_BLOCK`` tokens by the block's mass, then a token of that
    block by its logit, so P(token) = P(block) P(token | block), the distribution of
    ``jax.random.categorical`` over the whole row, from V / DRAW_BLOCK + DRAW_BLOCK Gumbel
    variates per row instead of V (their bits were most of a plain-sampling batch's sampler time
    on the TPU compiler's estimate); the block is read from ``logits`` and limited again, so the
    limited row is never written out. With rbg keys (Neuron's), whose bits are the hardware
    generator's, one categorical over the row moves fewer bytes (XLA's cost analysis of the 3B
    sampler: BENCHMARKS.md, "The sampler's share of a decode step") and is kept."""
    if str(jax.random.key_impl(keys_W)) != "threefry2x32":
        return jax.vmap(jax.random.categorical)(keys_W, logits_WxV if limit is None else limit(logits_WxV))
    limit = limit or (lambda x: x)
    V = logits_WxV.shape[-1]
    L = min(DRAW_BLOCK, V)
    padded = jnp.pad(limit(logits_WxV), ((0, 0), (0, -V % L)), constant_values=-jnp.inf)
    log_mass = jnp.log(_block_sums(jnp.exp(padded - shift_W), L))  # [W, V / L]
    block_keys, token_keys = jnp.moveaxis(jax.vmap(jax.random.split)(keys_W), 1, 0)
    b = jax.vmap(jax.random.categorical)(block_keys, log_mass)
    start = jnp.minimum(b * L, V - L)  # the last block, when short, is read with the end of the one before
    at = start[:, None] + jnp.arange(L)
    block = jnp.where(at >= (b * L)[:, None], limit(jnp.take_along_axis(logits_WxV, at, axis=-1)), -jnp.inf)
    return start + jax.vmap(jax.random.categorical)(token_keys, block)


def _block_sums(x_WxV: Array, L: int) -> Array:
    """[W, V / L]: each row's sums over blocks of L consecutive entries. The rows go in groups of
    ``ROW_GROUP`` (when W is a multiple), a view that is the TPU's own [W, V] tiling: as
    [W, V / L, L] the compiler lays the logits out vocabulary-major, a copy of all of them."""
    W, V = x_WxV.shape
    g = ROW_GROUP if W % ROW_GROUP == 0 else 1
    return jnp.sum(x_WxV.reshape(W // g, g, V // L, L), axis=-1).reshape(W, V // L)


def top_values(x_WxV: Array, k: int) -> Array:
    """[W, k]: each row's k largest values, descending (ties repeated), as ``lax.top_k`` gives them.
    In a program for TPU by rounds of at most ``TOP_K_PIECE``: the TPU compiler lowers a larger
    top-k as a sort of every row's whole vocabulary, values and indices, which its cost model does
    not even estimate; a round costs its TopK call and one pass that counts the ties."""
    return per_platform(x_WxV, default=lambda x: jax.lax.top_k(x, k)[0], tpu=lambda x: _top_values_in_rounds(x, k))


def _top_values_in_rounds(x_WxV: Array, k: int) -> Array:
    if k <= TOP_K_PIECE:
        return jax.lax.top_k(x_WxV, k)[0]
    first = jax.lax.top_k(x_WxV, TOP_K_PIECE)[0]
    low = jnp.min(first, axis=-1, keepdims=True)  # first[:, -1:], but a slice of top_k's result makes the TPU sort
    ties = jnp.sum(x_WxV >= low, axis=-1, keepdims=True)  # >= TOP_K_PIECE: ranks TOP_K_PIECE .. ties - 1 are low
    rest = _top_values_in_rounds(jnp.where(x_WxV < low, x_WxV, -jnp.inf), k - TOP_K_PIECE)
    rank = jnp.arange(TOP_K_PIECE, k)
    after = jnp.take_along_axis(rest, jnp.clip(rank - ties, 0, k - TOP_K_PIECE - 1), axis=-1)
    return jnp.concatenate([first, jnp.where(rank < ties, low, after)], axis=-1)


def _top_cutoff(
    scaled_WxV: Array, top_k_W: Array, top_p_W: Array, limited_W: Array, scaled_max_W: Array | None = None
) -> Array:
    """[W, 1]: each row's smallest logit inside its top-k and top-p (-inf for a row with neither:
    ``limited`` false). ``scaled_max`` [W, 1]: each row's maximum, where the caller has it (the
    softmax's normalizer then takes one pass over the row, not two)."""
    top = top_values(scaled_WxV, min(CANDIDATES, scaled_WxV.shape[-1]))  # [W, K] descending
    k = jnp.where(top_k_W > 0, jnp.minimum(top_k_W, top.shape[-1]), top.shape[-1])
    kth = jnp.take_along_axis(top, (k - 1)[:, None], axis=-1)  # k-th largest
    probs = jnp.exp(top - _logsumexp(scaled_WxV, scaled_max_W))
    before = jnp.cumsum(probs, axis=-1) - probs  # mass strictly above each candidate
    cutoff = jnp.min(jnp.where(before < top_p_W[:, None], top, jnp.inf), axis=-1, keepdims=True)  # smallest kept
    return jnp.where(limited_W[:, None], jnp.maximum(kth, cutoff), -jnp.inf)


def _logsumexp(x_WxV: Array, max_W: Array | None) -> Array:
    """[W, 1]: ``jax.nn.logsumexp`` over the last axis (its arithmetic), given each row's maximum
    ``max`` [W, 1] where it is known."""
    if max_W is None:
        return jax.nn.logsumexp(x_WxV, axis=-1, keepdims=True)
    shift = jnp.where(jnp.isfinite(max_W), max_W, 0.0)  # the sampler is never differentiated
    return jnp.log(jnp.sum(jnp.exp(x_WxV - shift), axis=-1, keepdims=True)) + shift


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
    residual = residual.reshape(W * N, V)
    shift = jnp.max(residual, axis=-1, keepdims=True)  # its own: a rejected draft may have held nearly all the mass
    drawn = draw(keys[:, 1].reshape(W * N), residual, shift).reshape(W, N).astype(jnp.int32)
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
