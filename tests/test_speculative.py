"""n-gram proposals against a brute-force search; speculative generation against plain decoding."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from laplace_jax.speculative import MAX_MISS_PAUSE, MAX_PAUSE, backoff, ngram_proposal, speculative_sample


def _brute_force(tokens: list[int], k: int, n_min: int, n_max: int) -> list[int]:
    for n in range(n_max, n_min - 1, -1):
        if n >= len(tokens):
            continue
        suffix = tokens[-n:]
        starts = [i for i in range(len(tokens) - n) if tokens[i : i + n] == suffix]
        if starts:
            start = starts[-1] + n
            return [tokens[start + j % (len(tokens) - start)] for j in range(k)]
    return []


def _proposal(seq: list[int], k: int, n_min: int = 1, n_max: int = 4) -> list[int]:
    """``ngram_proposal`` compiled, over ``seq`` in a 48-slot buffer (junk after it must not match)."""
    buf = jnp.asarray(list(seq) + [7] * (48 - len(seq)), jnp.int32)
    fn = jax.jit(ngram_proposal, static_argnums=(2, 3, 4))
    out = np.asarray(fn(buf, jnp.int32(len(seq)), k, n_min, n_max))
    assert np.all(out >= 0) or np.all(out < 0)
    return [int(t) for t in out if t >= 0]


def test_ngram_proposal_examples_and_a_brute_force_search():
    assert _proposal([1, 2, 3, 4, 1, 2], 3) == [3, 4, 1]
    assert _proposal([5, 6, 9, 5, 6, 7, 5, 6], 2) == [7, 5]  # the latest occurrence
    assert _proposal([1, 2, 3], 4) == [] and _proposal([1, 2, 1], 4, n_min=2) == []
    assert _proposal([1, 2, 1], 4) == [2, 1, 2, 1]  # the loop continued
    assert _proposal([9, 3, 3, 3], 3) == [3, 3, 3]
    rng = np.random.default_rng(0)
    for k, lo, hi in [(4, 1, 4), (3, 2, 3), (5, 1, 1)]:
        for _ in range(40):
            seq = [int(t) for t in rng.integers(0, 4, rng.integers(1, 41))]
            assert _proposal(seq, k, lo, hi) == _brute_force(seq, k, lo, hi), (seq, k, lo, hi)


def test_failed_speculation_pauses_the_lookups_and_an_accepted_token_resumes_them():
    """Events per step: "miss" (looked, no n-gram), "reject" (a draft, none accepted), "accept",
    "-" (no look-up). Look-ups run only at skip 0; pauses double to their caps."""

    def run(events):
        skip, pause, ran = jnp.int32(0), jnp.int32(1), []
        for e in events:
            looked = bool(skip == 0) and e != "-"
            ran.append(looked)
            proposed, accepted = looked and e in ("reject", "accept"), 2 if looked and e == "accept" else 0
            skip, pause = backoff(skip, pause, jnp.bool_(looked), jnp.bool_(proposed), jnp.int32(accepted))
        return ran, int(pause)

    ran, pause = run(["miss"] * 40)  # a miss skips the next 1, 2, 4, then 8 look-ups
    assert [i for i, r in enumerate(ran) if r] == [0, 2, 5, 10, 19, 28, 37] and pause == MAX_MISS_PAUSE
    ran, pause = run(["reject"] * 200)  # a rejection skips the next 1, 2, 4 .. 64
    assert [i for i, r in enumerate(ran) if r] == [0, 2, 5, 10, 19, 36, 69, 134, 199] and pause == MAX_PAUSE
    ran, pause = run(["reject"] * 10 + ["accept"] * 5)  # an accepted token: a look-up every step again
    assert ran[-3:] == [True] * 3 and pause == 1


@pytest.fixture(scope="module")
def tiny():
    from laplace_jax.config import load_run_config
    from laplace_jax.models.gla_lm import init_params

    cfg = load_run_config("configs/tiny.py").model
    return cfg, init_params(cfg, jax.random.key(0))


def test_greedy_speculation_equals_plain_greedy_decoding(tiny):
    """Greedy: token for token the output of ``generate.sample`` (prefill, then decode steps), on a
    prompt that repeats itself (drafts accepted) and on one that does not."""
    from laplace_jax.generate import sample

    cfg, params = tiny
    rng = np.random.default_rng(0)
    phrase = list(rng.integers(0, cfg.vocab_size, 12))
    for prompt in (phrase * 4, list(rng.integers(0, cfg.vocab_size, 48))):  # one length: one compile
        want = sample(cfg, params, prompt, 40, temperature=0.0)
        got, stats = speculative_sample(cfg, params, prompt, 40, temperature=0.0)
        assert got == want
        assert stats.proposed >= stats.accepted and stats.verify_calls + stats.plain_steps == 40 - stats.accepted


def test_sampled_speculation_runs_to_length_and_refuses_bad_settings(tiny):
    cfg, params = tiny
    prompt = [3, 4] * 24  # the greedy test's lengths: its compiled loop (the limits are traced)
    out, stats = speculative_sample(cfg, params, prompt, 40, temperature=1.0, top_k=8, seed=1)
    assert len(out) == 40 and all(0 <= t < cfg.vocab_size for t in out) and stats.proposed > 0
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        speculative_sample(cfg, params, [1], 4, prompt_lookup_min=3, prompt_lookup_max=2)
