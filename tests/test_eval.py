"""Recall generators, scoring, the model scorer, and the numerics report (issue 6, in progress)."""

import re

import jax
import numpy as np
import pytest

from laplace_jax import ModelConfig, init_params
from laplace_jax.data.tokenizer import ByteTokenizer
from laplace_jax.eval.numerics import report
from laplace_jax.eval.recall import model_answers, mqar, passkey, score, suite
from laplace_jax.serve.engine import Engine


def test_generators_are_deterministic_and_answers_derivable():
    for s in suite("mqar", 0, [256, 1024], [4, 32], 5) + suite("passkey", 0, [256, 1024], [0.0, 0.5, 1.0], 5):
        if s.prompt.endswith(":"):  # MQAR
            key = s.prompt.rsplit("\n", 1)[1][:-1]
            context = s.prompt.rsplit("\n", 1)[0]
            assert context.count(key) == 1 and context.count(f"{key}:{s.answer}.") == 1
        else:
            assert s.prompt.count(s.answer) == 1 and "The pass key is" in s.prompt
        assert abs(len(s.prompt) - s.length) <= 60
    assert mqar(3, 512, 8) == mqar(3, 512, 8) and mqar(3, 512, 8) != mqar(4, 512, 8)
    assert passkey(1, 300, 0.25) == passkey(1, 300, 0.25)
    with pytest.raises(ValueError, match="more than the context length"):
        mqar(0, 64, 50)


def oracle(samples):
    out = []
    for s in samples:
        if s.prompt.endswith(":"):
            key = s.prompt.rsplit("\n", 1)[1][:-1]
            out.append(re.search(rf"{key}:(\d+)\.", s.prompt).group(1))
        else:
            out.append(re.search(r"The pass key is (\d+)\. ", s.prompt).group(1))
    return out


def test_oracle_scores_100_and_random_near_chance():
    samples = suite("mqar", 0, [512], [8, 16], 20) + suite("passkey", 0, [512], [0.5], 20)
    assert all(r["accuracy"] == 1.0 for r in score(samples, oracle).values())
    rng = np.random.default_rng(0)
    guess = lambda ss: [str(rng.integers(1000, 100000)) for _ in ss]  # noqa: E731
    assert max(r["accuracy"] for r in score(samples, guess).values()) <= 0.1  # chance is ~1e-4


def test_model_scorer_runs_through_the_engine():
    cfg = ModelConfig(vocab_size=256, d_model=64, n_layers=2, n_heads=2, use_short_conv=True, chunk_size=16)
    params = init_params(cfg, jax.random.key(0))
    tok = ByteTokenizer()
    samples = suite("passkey", 0, [200, 400], [0.5], 2)
    factory = lambda: Engine(cfg, params, eos_id=0, max_num_seqs=2, prefill_chunk=64, max_model_len=1024)  # noqa: E731
    res = score(samples, model_answers(factory, tok))
    assert set(res) == {"200|0.5", "400|0.5"} and all(0.0 <= r["accuracy"] <= 1.0 for r in res.values())


def test_numerics_report_bounds_on_a_tiny_model():
    cfg = ModelConfig(
        vocab_size=256, d_model=64, n_layers=2, n_heads=2, use_short_conv=True, chunk_size=16, init_std=0.1
    )
    params = init_params(cfg, jax.random.key(0))
    tokens = np.random.default_rng(0).integers(1, 256, (2, 100)).astype(np.int32)
    rep = report(cfg, params, tokens, decode_steps=8)
    assert rep["jit_vs_eager"]["rms_rel"] <= 1e-5
    assert rep["chunk_vs_recurrent"]["rms_rel"] <= 1e-4
    assert rep["fp32_vs_bf16"]["rms_rel"] <= 3e-2  # the README's bf16 bound
    assert 0.0 <= rep["greedy_fp32_vs_bf16"]["agree"] <= 1.0
