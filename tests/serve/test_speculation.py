"""Speculative decoding in the server (``--speculative-config``, n-gram lookup): greedy output,
logprobs, stops, min_tokens and prefix-cache hits exactly as a plain server gives them; the
counters come from the device; no compile after warmup; bad configs refused by name."""

import dataclasses
from concurrent.futures import ThreadPoolExecutor

import httpx
import jax
import numpy as np
import pytest
import scipy.stats
from serving_helpers import CFG, TOK, Running, reference_greedy

from laplace_jax import init_params
from laplace_jax.serve.config import ServeConfig, SettingError
from laplace_jax.serve.metrics import sample_sum
from laplace_jax.serve.request import Request, SamplingParams
from laplace_jax.serve.slots import Slots

SPEC = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}'
# a model whose greedy output falls into loops (drafts accepted) and leaves them (drafts rejected)
LOOPY = init_params(dataclasses.replace(CFG, init_std=0.05), jax.random.key(1))
PROMPTS = ["abcabcabcabcabcabc", "the cat sat on the mat. the cat sat on the mat. the cat", "hello", "x"]
ENGINE = dict(
    params=LOOPY, max_num_seqs=4, prefill_chunk=16, steps_per_call=4, decode_buckets="4"
)  # one compiled width


@pytest.fixture(scope="module")
def pair():
    """(speculative server, plain server), the same model and settings otherwise."""
    spec, plain = Running(speculative_config=SPEC, **ENGINE), Running(**ENGINE)
    yield spec, plain
    spec.close()
    plain.close()


def _text(srv, body: dict) -> dict:
    r = srv.post({"model": "tiny", "temperature": 0, **body})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def test_greedy_output_is_plain_decodings_token_for_token_with_drafts_accepted_and_rejected(pair):
    spec, _ = pair
    bodies = [{"prompt": p, "max_tokens": n} for p in PROMPTS for n in (7, 40)]
    with ThreadPoolExecutor(8) as pool:  # 8 requests on 4 slots: rows with and without drafts share calls
        got = list(pool.map(lambda b: _text(spec, b), bodies))
    for body, choice in zip(bodies, got, strict=True):
        want = reference_greedy(TOK.encode(body["prompt"]), body["max_tokens"], params=LOOPY)
        assert choice["text"] == TOK.decode(want), body
    hits = spec.engine.prefix.stats.hits
    for body in bodies[::2]:  # again, each resumed from its cached final state
        want = reference_greedy(TOK.encode(body["prompt"]), 40, params=LOOPY)
        assert _text(spec, dict(body, max_tokens=40))["text"] == TOK.decode(want)
    assert spec.engine.prefix.stats.hits > hits
    drafts, proposed, accepted = spec.engine.programs.speculation_counts
    assert 0 < accepted < proposed and drafts > 0  # both outcomes were exercised
    assert spec.engine.compiles.total("serving") == 0


def test_metrics_report_the_devices_counts(pair):
    spec, _ = pair
    _text(spec, {"prompt": PROMPTS[0], "max_tokens": 30})
    text = httpx.get(spec.url + "/metrics").text
    drafts, proposed, accepted = spec.engine.programs.speculation_counts
    assert sample_sum(text, "laplace:spec_decode_num_draft_tokens_total") == proposed
    assert sample_sum(text, "vllm:spec_decode_num_accepted_tokens_total") == accepted > 0
    assert sample_sum(text, "vllm:spec_decode_num_drafts_total") == drafts


@pytest.mark.parametrize(
    "body",
    [
        {"max_tokens": 30, "logprobs": 3},
        {"max_tokens": 30, "stop": ["\x73\x73"]},
        {"max_tokens": 24, "min_tokens": 20, "stop_token_ids": [115]},
        {"max_tokens": 25, "logit_bias": {"115": -100}},
        {"max_tokens": 9, "echo": True, "logprobs": 1},
    ],
    ids=["logprobs", "stop-string", "min-tokens", "logit-bias", "echo"],
)
def test_request_options_behave_as_without_speculation(pair, body):
    spec, plain = pair
    for prompt in PROMPTS[:2]:
        a, b = _text(spec, dict(body, prompt=prompt)), _text(plain, dict(body, prompt=prompt))
        assert (a["text"], a["finish_reason"]) == (b["text"], b["finish_reason"])
        if body.get("logprobs"):
            la, lb = a["logprobs"], b["logprobs"]
            assert la["tokens"] == lb["tokens"]
            got = [x for x in la["token_logprobs"] if x is not None]
            want = [x for x in lb["token_logprobs"] if x is not None]
            np.testing.assert_allclose(got, want, atol=1e-4)  # verify's prefill vs the decode step: fp32 rounding


def test_seeded_sampling_is_reproducible_and_runs_to_length(pair):
    spec, _ = pair
    body = {"prompt": PROMPTS[0], "max_tokens": 32, "temperature": 0.8, "top_k": 20, "seed": 7, "ignore_eos": True}
    first, second = spec.post({"model": "tiny", **body}).json(), spec.post({"model": "tiny", **body}).json()
    assert first["choices"] == second["choices"] and first["choices"][0]["finish_reason"] == "length"
    assert first["usage"]["completion_tokens"] == 32


def test_sampled_tokens_keep_plain_decodings_distribution(pair):
    """Every token of a 256-id prompt occurs in it, so after the first sampled token the 1-gram
    look-up always drafts: the next two tokens come from the rejection rule. The three tokens'
    joint distribution over 300 seeds (top_k 3: at most 27 outcomes) against the plain server's:
    a chi-square homogeneity test at p = 0.001 does not tell them apart (a rule that accepts every
    draft token shares no outcome with plain decoding here: chi2 600)."""
    spec, plain = pair
    prompt = [int(t) for t in np.random.default_rng(0).permutation(256)]
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 3, "temperature": 1.0, "top_k": 3, "ignore_eos": True}
    body |= {"logprobs": 0, "return_tokens_as_token_ids": True}  # the ids, whatever bytes they are
    drafts = spec.engine.programs.speculation_counts[0]

    def outcomes(srv):
        with ThreadPoolExecutor(4) as pool:
            got = pool.map(lambda seed: srv.post({**body, "seed": seed}).json(), range(300))
            return [tuple(r["choices"][0]["logprobs"]["tokens"]) for r in got]

    a, b = outcomes(spec), outcomes(plain)
    assert spec.engine.programs.speculation_counts[0] - drafts >= 300  # every request verified drafts
    keys = sorted(set(a) | set(b))
    table = np.asarray([[x.count(k) for k in keys] for x in (a, b)], float)
    expected = table.sum(1, keepdims=True) * table.sum(0, keepdims=True) / table.sum()
    chi2 = float(((table - expected) ** 2 / expected).sum())
    df = len(keys) - 1
    assert chi2 < scipy.stats.chi2.ppf(0.999, df), (chi2, df)


def test_a_row_hands_every_emitted_position_in_order():
    """A speculative call's valid positions have gaps (1 .. K + 1 real tokens per step)."""
    slots = Slots(1, 1)
    got = []
    req = Request([1], SamplingParams(max_tokens=10), lambda toks, reason: got.append((list(toks), reason)))
    slots.rows[0].append(req)
    toks = np.asarray([5, 6, 0, 7, 0, 0, 8, 9], np.int32)[:, None, None]
    valid = np.asarray([1, 1, 0, 1, 0, 0, 1, 1], bool)[:, None, None]
    slots.collect(toks, valid, (None, None, None))
    assert got == [([5, 6, 7, 8, 9], None)]


@pytest.mark.parametrize(
    "text, words",
    [
        ("{", "not valid JSON"),
        ('{"method": "eagle", "num_speculative_tokens": 2}', "only 'ngram'"),
        ('{"num_speculative_tokens": 12}', "1..7"),
        ('{"num_speculative_token": 3}', "unknown field(s) num_speculative_token"),
        (
            '{"num_speculative_tokens": 3, "prompt_lookup_min": 5, "prompt_lookup_max": 4}',
            "prompt_lookup_min <= prompt_lookup_max",
        ),
    ],
)
def test_a_bad_speculative_config_is_refused_by_name(text, words):
    with pytest.raises(SettingError, match="speculative_config") as e:
        ServeConfig(speculative_config=text)
    assert words in str(e.value)
