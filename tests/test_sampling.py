"""On-device sampling on a fixed distribution: greedy limits, top-k / top-p supports and frequencies."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from laplace_jax.errors import InvalidParamError
from laplace_jax.sampling import sample_rows
from laplace_jax.serve.request import SamplingParams, prng_key_data

PROBS = np.array([0.30, 0.22, 0.16, 0.12, 0.09, 0.06, 0.03, 0.02])  # sorted, distinct
LOGITS = np.log(PROBS)[np.random.default_rng(0).permutation(8)]  # shuffled so order is not by index
N = 20_000


def draw(temperature=1.0, top_k=0, top_p=1.0, n=N, logits=LOGITS) -> np.ndarray:
    keys = jax.random.split(jax.random.key(0), n)
    rows = jnp.broadcast_to(jnp.asarray(logits, jnp.float32), (n, len(logits)))
    f = jax.jit(sample_rows)
    full = lambda v, dt: jnp.full((n,), v, dt)  # noqa: E731
    return np.asarray(f(rows, full(temperature, jnp.float32), full(top_k, jnp.int32), full(top_p, jnp.float32), keys))


def expected(support: np.ndarray) -> np.ndarray:
    p = np.where(support, np.exp(LOGITS), 0.0)
    return p / p.sum()


def check_frequencies(tokens: np.ndarray, want: np.ndarray) -> None:
    freq = np.bincount(tokens, minlength=len(want)) / len(tokens)
    assert np.all(freq[want == 0] == 0), "a token outside the support was drawn"
    # binomial standard error at N=20k is <= 0.0035: 5 sigma
    np.testing.assert_allclose(freq, want, atol=0.018)


def test_greedy_limits_equal_argmax():
    best = int(np.argmax(LOGITS))
    assert set(draw(temperature=0.0, n=64)) == {best}
    assert set(draw(top_k=1, n=2000)) == {best}
    assert set(draw(top_p=1e-6, n=2000)) == {best}


@pytest.mark.parametrize("k", [2, 3, 5])
def test_top_k_draws_stay_in_the_top_k_with_renormalised_frequencies(k):
    rank = np.argsort(np.argsort(-LOGITS))  # 0 = most likely
    check_frequencies(draw(top_k=k), expected(rank < k))


@pytest.mark.parametrize("p", [0.5, 0.7, 0.9])
def test_top_p_keeps_the_smallest_prefix_reaching_p(p):
    order = np.argsort(-LOGITS)
    mass_before = np.cumsum(PROBS) - PROBS  # PROBS is sorted like order
    support = np.zeros(8, bool)
    support[order[mass_before < p]] = True
    check_frequencies(draw(top_p=p), expected(support))


def test_temperature_sharpens_like_the_scaled_softmax():
    t = 0.5
    want = np.exp(LOGITS / t) / np.exp(LOGITS / t).sum()
    check_frequencies(draw(temperature=t), want)


def test_host_key_data_matches_jax_random_key():
    for seed in (0, 1, 12345, 2**31 - 1):
        np.testing.assert_array_equal(prng_key_data(seed), jax.random.key_data(jax.random.key(seed)))
    np.testing.assert_array_equal(prng_key_data(2**63 - 1), [0x7FFFFFFF, 0xFFFFFFFF])


@pytest.mark.parametrize(
    "field,value",
    [
        ("max_tokens", 0),
        ("temperature", -0.5),
        ("temperature", 2.5),
        ("temperature", float("nan")),
        ("top_p", 0.0),
        ("top_p", 1.01),
        ("top_k", -1),
        ("top_k", 257),
        ("seed", -1),
        ("seed", 2**63),
        ("stop_token_ids", (256,)),
        ("stop_token_ids", tuple(range(16))),
    ],
)
def test_sampling_params_reject_out_of_range_values(field, value):
    with pytest.raises(InvalidParamError) as e:
        SamplingParams(**{field: value}).check(vocab_size=256)
    assert e.value.param == field
    SamplingParams(top_k=256, seed=2**63 - 1, temperature=2.0, stop_token_ids=tuple(range(15))).check(256)


def test_rbg_key_data_built_on_the_host_matches_jax():
    for seed in (0, 5, 2**31 + 3):
        want = jax.random.key_data(jax.random.key(seed, impl="rbg"))
        np.testing.assert_array_equal(prng_key_data(seed, "rbg"), want)


def test_prng_impl_setting():
    from laplace_jax.errors import ConfigError
    from laplace_jax.platform import prng_impl

    assert prng_impl("auto") == "threefry2x32"  # CPU; rbg on Neuron
    assert prng_impl("rbg") == "rbg"
    with pytest.raises(ConfigError, match="prng_impl must be one of"):
        prng_impl("rgb")


def test_large_vocab_limits_act_on_the_candidates_and_unlimited_rows_see_every_token():
    """V = 4096 > CANDIDATES: top-k and top-p draws stay in their exact sets; a row with neither
    limit draws tokens outside the 1,024 candidates too (nearly flat logits)."""
    from laplace_jax.sampling import CANDIDATES

    V, n = 4096, 512
    logits = np.random.default_rng(0).standard_normal(V).astype(np.float32) * 0.1
    order = np.argsort(-logits)
    rows = lambda x, dt: jnp.full((n,), x, dt)  # noqa: E731
    keys = jax.random.split(jax.random.key(1), n)
    L = jnp.broadcast_to(jnp.asarray(logits), (n, V))
    top_k = np.asarray(sample_rows(L, rows(1.0, jnp.float32), rows(1000, jnp.int32), rows(1.0, jnp.float32), keys))
    assert set(top_k) <= set(order[:1000].tolist())
    probs = np.exp(logits - logits.max())
    probs /= probs.sum()
    mass_before = np.cumsum(probs[order]) - probs[order]
    nucleus = set(order[mass_before < 0.1].tolist())
    assert len(nucleus) < CANDIDATES
    top_p = np.asarray(sample_rows(L, rows(1.0, jnp.float32), rows(0, jnp.int32), rows(0.1, jnp.float32), keys))
    assert set(top_p) <= nucleus
    free = np.asarray(sample_rows(L, rows(1.0, jnp.float32), rows(0, jnp.int32), rows(1.0, jnp.float32), keys))
    assert len(set(free) - set(order[:CANDIDATES].tolist())) > 100
    with pytest.raises(InvalidParamError, match="top_k must lie in"):
        SamplingParams(top_k=CANDIDATES + 1).check(vocab_size=V)


def test_a_row_draws_alike_whatever_limits_the_other_rows_of_its_batch_set():
    """Each limit's work runs only when some row of the batch sets it (``limit_logits``): a row's
    limited logits and its draw are the same bit for bit alone, beside a top-k row and beside a
    min-p row; and a batch without limits keeps every logit (only the temperature applies)."""
    from laplace_jax.sampling import limit_logits

    V = 3000
    logits = jnp.asarray(np.random.default_rng(2).standard_normal((3, V)).astype(np.float32) * 2)
    kinds = {"plain": (1.3, 0, 1.0, 0.0), "top-k": (0.7, 40, 1.0, 0.0), "min-p": (1.0, 0, 1.0, 0.1)}
    keys = jax.random.split(jax.random.key(3), 3)

    def batch(names):
        cols = list(zip(*(kinds[n] for n in names), strict=True))
        t, k, p, m = (
            jnp.asarray(c, dt) for c, dt in zip(cols, (jnp.float32, jnp.int32, jnp.float32, jnp.float32), strict=True)
        )
        own = jnp.asarray([list(kinds).index(n) for n in names])  # each kind keeps its logits and key
        rows = logits[own]
        return np.asarray(limit_logits(rows, t, k, p, m)), np.asarray(sample_rows(rows, t, k, p, keys[own], m))

    alone, alone_tok = batch(["plain"])
    np.testing.assert_array_equal(alone[0], np.asarray(logits[0] / jnp.float32(1.3)))  # no limit: every logit
    for others in (["plain", "top-k"], ["plain", "min-p"], ["plain", "top-k", "min-p"]):
        limited, toks = batch(others)
        np.testing.assert_array_equal(limited[0], alone[0])
        assert toks[0] == alone_tok[0]
        assert np.isinf(limited[1]).sum() > 0  # the other row's limit did act
    solo_k, _ = batch(["top-k"])
    np.testing.assert_array_equal(batch(["plain", "top-k"])[0][1], solo_k[0])


def test_the_candidates_top_k_runs_only_inside_a_branch_a_limit_takes():
    """In the compiled program (XLA:CPU) the top-k over the vocabulary is reached only through a
    conditional's branch, so a batch whose rows set no top-k or top-p never runs it."""
    from laplace_jax.hlo_stats import Module
    from laplace_jax.sampling import limit_logits

    W, V = 4, 2048
    args = (jnp.zeros((W, V)), jnp.ones(W), jnp.zeros(W, jnp.int32), jnp.ones(W), jnp.zeros(W))
    module = Module(jax.jit(limit_logits).lower(*args).compile().as_text())

    def top_k_ops(comps):
        return [i for c in comps for i in module.computations[c] if i.opcode == "sort" or "TopK" in i.rest]

    assert top_k_ops(module.computations)  # the program has one
    assert top_k_ops(module.multiplicities(branch=lambda ins: "")) == []  # but not outside every branch


def _chi_square(tokens: np.ndarray, want: np.ndarray) -> float:
    """Pearson's statistic of ``tokens`` against the probabilities ``want`` (cells with mass)."""
    seen = np.bincount(tokens, minlength=len(want))
    assert np.all(seen[want == 0] == 0), "a token outside the support was drawn"
    exp = want[want > 0] * len(tokens)
    return float(np.sum((seen[want > 0] - exp) ** 2 / exp))


@pytest.mark.parametrize("ranks", [(0, 0), (4, 1), (7, 0), None])
def test_speculative_acceptance_keeps_the_plain_sampling_distribution(ranks):
    """Three positions with their own fixed logits (so each token's distribution does not depend
    on the one before), top-k 6 and temperature 0.8; a two-token draft by rank at positions 0 and 1
    (the likeliest tokens; an unlikely one; one outside the top-k; none). The first emitted token
    follows position 0's limited softmax and, when the first draft token was kept (about as often
    as its probability), the second follows position 1's: chi-square with 5 degrees of freedom
    below 20.5 (p = 0.001), against a numpy softmax."""
    from laplace_jax.sampling import speculative_accept

    rng = np.random.default_rng(1)
    logits = np.stack([LOGITS, rng.permutation(LOGITS), rng.permutation(LOGITS)])  # [N=3, V]
    n, t, k = N, 0.8, 6

    def limited(row):  # numpy: temperature, then the k most likely renormalized
        p = np.exp(row / t - np.max(row / t))
        p[np.argsort(-row)[k:]] = 0
        return p / p.sum()

    draft = [-1, -1] if ranks is None else [int(np.argsort(-logits[j])[r]) for j, r in enumerate(ranks)]
    full = lambda v, dt: jnp.full((n,), v, dt)  # noqa: E731
    tokens, accepted = jax.jit(speculative_accept)(
        jnp.broadcast_to(jnp.asarray(logits, jnp.float32), (n, 3, 8)),
        jnp.broadcast_to(jnp.asarray(draft, jnp.int32), (n, 2)),
        full(t, jnp.float32),
        full(k, jnp.int32),
        full(1.0, jnp.float32),
        jax.random.split(jax.random.key(2), n),
    )
    tokens, accepted = np.asarray(tokens), np.asarray(accepted)
    assert _chi_square(tokens[:, 0], limited(logits[0])) < 20.5
    kept = accepted >= 1
    p_kept = 0.0 if ranks is None else limited(logits[0])[draft[0]]
    assert abs(kept.mean() - p_kept) < 0.02 and np.all(tokens[kept, 0] == draft[0])
    if p_kept > 0.1:
        assert _chi_square(tokens[kept, 1], limited(logits[1])) < 20.5


def test_greedy_speculation_keeps_the_argmax_prefix():
    """Both the general rule at temperature 0 and ``greedy_accept`` (no draws, used when every row
    is greedy) keep the draft while it equals the argmax."""
    from laplace_jax.sampling import greedy_accept, speculative_accept

    logits = jnp.asarray(np.eye(8)[[2, 5, 7, 1]][None] * 4.0, jnp.float32)  # argmax 2, 5, 7, 1
    zero = jnp.zeros((1,))
    for draft, want_n, want in [((2, 5, 7), 3, [2, 5, 7, 1]), ((2, 4, 7), 1, [2, 5]), ((6, 5, 7), 0, [2])]:
        tokens, n = speculative_accept(
            logits, jnp.asarray([draft]), zero, zero.astype(int), zero + 1, jax.random.split(jax.random.key(0), 1)
        )
        assert int(n[0]) == want_n and list(np.asarray(tokens[0, : want_n + 1])) == want
        g_tokens, g_n = greedy_accept(logits, jnp.asarray([draft]))
        assert int(g_n[0]) == want_n and np.array_equal(np.asarray(g_tokens), np.asarray(tokens))


@pytest.mark.parametrize("k", [300, 700, 1100])
def test_top_values_in_rounds_of_the_tpus_topk_are_lax_top_ks_values(k):
    """The TPU form of the candidates (rounds of TOP_K_PIECE, here of 256 so k 700 and 1,100
    take three and five rounds) gives ``lax.top_k``'s values, descending, with ties repeated
    across a round's edge and -inf rows and tails where logits are masked."""
    from unittest import mock

    from laplace_jax import sampling

    rng = np.random.default_rng(4)
    x = np.stack(
        [
            rng.integers(-20, 20, 3000).astype(np.float32),  # ~75 copies of each value: ties at every edge
            rng.standard_normal(3000).astype(np.float32),
            np.where(np.arange(3000) < 600, rng.standard_normal(3000), -np.inf).astype(np.float32),  # 600 finite
            np.full(3000, -np.inf, np.float32),
        ]
    )
    with mock.patch.object(sampling, "TOP_K_PIECE", 256):
        got = np.asarray(jax.jit(sampling._top_values_in_rounds, static_argnums=1)(jnp.asarray(x), k))
    np.testing.assert_array_equal(got, np.asarray(jax.lax.top_k(jnp.asarray(x), k)[0]))
    np.testing.assert_array_equal(got, -np.sort(-x, axis=-1)[:, :k])


@pytest.mark.parametrize("V,impl", [(300, "threefry2x32"), (1024, "threefry2x32"), (300, "rbg")])
def test_a_block_then_token_draw_follows_the_softmax(V, impl):
    """``draw`` (threefry keys: a block of DRAW_BLOCK tokens by its mass, then a token in it; rbg
    keys: one categorical over the row) against a numpy softmax over 40 tokens spread across every
    block (V = 300: the short last block is read with the end of the one before, which must never
    be drawn from it), -inf tokens never drawn, and a ``limit`` applied: chi-square with 39 degrees
    of freedom below 80 (p < 1e-4)."""
    from laplace_jax.sampling import draw

    n = 40_000
    support = np.random.default_rng(5).choice(V, 40, replace=False)
    support[0] = V - 1  # the last token, in the short block when V = 300
    logits = np.full(V, -np.inf, np.float32)
    logits[support] = np.random.default_rng(6).standard_normal(40).astype(np.float32) * 2
    t = 1.5
    want = np.where(np.isfinite(logits), np.exp(logits / t - np.max(logits / t)), 0.0)
    want /= want.sum()
    rows = jnp.broadcast_to(jnp.asarray(logits), (n, V))
    shift = jnp.full((n, 1), np.max(logits) / t, jnp.float32)
    keys = jax.random.split(jax.random.key(7, impl=impl), n)
    tokens = np.asarray(jax.jit(lambda k, x, s: draw(k, x, s, lambda x: x / t))(keys, rows, shift))
    assert _chi_square(tokens, want) < 80


@pytest.mark.parametrize("W", [16, 5])
def test_block_sums_in_row_groups_are_the_blocks_sums(W):
    """``_block_sums`` (rows in groups of the TPU's fp32 tile when W is a multiple of it, as they
    are when not) against float64 sums of each row's blocks, to fp32 summation error."""
    from laplace_jax.sampling import DRAW_BLOCK, _block_sums

    x = np.random.default_rng(3).standard_normal((W, 3 * DRAW_BLOCK)).astype(np.float32)
    got = np.asarray(jax.jit(_block_sums, static_argnums=1)(jnp.asarray(x), DRAW_BLOCK))
    want = x.astype(np.float64).reshape(W, 3, DRAW_BLOCK).sum(-1)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-4)  # |sum| of 128 N(0,1) ~ 11; fp32 ulp ~1e-6


def test_a_known_row_maximum_gives_the_same_top_cutoff():
    """``_top_cutoff`` with each row's maximum handed in (the sampler's: one pass for the softmax's
    normalizer, not two) gives the cutoff it computes alone, bit for bit, rows with -inf entries
    included."""
    from laplace_jax.sampling import _top_cutoff

    rng = np.random.default_rng(4)
    x = rng.standard_normal((8, 2000)).astype(np.float32) * 3
    x[rng.random(x.shape) < 0.3] = -np.inf
    top_k = jnp.asarray([0, 1, 5, 50, 0, 2000, 7, 0])
    top_p = jnp.asarray([0.9, 1.0, 0.5, 0.99, 0.1, 1.0, 0.7, 1.0], jnp.float32)
    limited = (top_k > 0) | (top_p < 1)
    alone = jax.jit(_top_cutoff)(jnp.asarray(x), top_k, top_p, limited)
    given = jax.jit(_top_cutoff)(jnp.asarray(x), top_k, top_p, limited, jnp.max(jnp.asarray(x), -1, keepdims=True))
    np.testing.assert_array_equal(np.asarray(given), np.asarray(alone))
    assert np.isfinite(np.asarray(alone)[np.asarray(limited)]).all()


def test_the_tpus_scatter_counts_tokens_as_the_comparison_does():
    """``count_tokens``' TPU branch (a scatter, traced here as a TPU program traces it) against the
    comparison every other backend runs: the same counts, invalid rows unchanged."""
    from laplace_jax.platform import only_for
    from laplace_jax.sampling import count_tokens

    counts = jnp.asarray(np.random.default_rng(5).integers(0, 4, (6, 300)), jnp.int32)
    tokens = jnp.asarray([0, 299, 17, 17, 150, 3])
    valid = jnp.asarray([True, True, False, True, True, False])
    compared = jax.jit(lambda c, t, v: count_tokens(c, t, v))(counts, tokens, valid)
    with only_for("tpu"):
        scattered = jax.jit(lambda c, t, v: count_tokens(c, t, v))(counts, tokens, valid)
    want = np.asarray(counts).copy()
    want[np.arange(6)[np.asarray(valid)], np.asarray(tokens)[np.asarray(valid)]] += 1
    np.testing.assert_array_equal(np.asarray(compared), want)
    np.testing.assert_array_equal(np.asarray(scattered), want)
