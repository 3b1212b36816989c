"""Recall generators and training windows, scoring, the model scorer, the numerics report, and the
eval CLI's outputs and bad-input messages."""

import dataclasses
import json
import re
import subprocess
import sys

import jax
import numpy as np
import pytest
import torch
from helpers import ROOT, child_env
from serving_helpers import serve_config

from laplace_jax import ModelConfig, forward, init_params
from laplace_jax.checkpoint import save_model
from laplace_jax.data.prepare import prepare
from laplace_jax.data.synthetic import NO_LOSS, MQARWindows
from laplace_jax.data.tokenizer import ByteTokenizer
from laplace_jax.errors import DataError
from laplace_jax.eval.__main__ import main as eval_main
from laplace_jax.eval.numerics import report
from laplace_jax.eval.recall import answer_token, model_answers, score
from laplace_jax.generate import sample
from laplace_jax.loss import loss_fn
from laplace_jax.serve.engine import Engine
from laplace_jax.serve.request import Request, SamplingParams
from laplace_jax.tasks.recall import max_pairs, mqar, passkey, suite

MICRO = ModelConfig(vocab_size=256, d_model=64, n_layers=2, n_heads=2, use_short_conv=True, chunk_size=16, init_std=0.1)


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
    with pytest.raises(ValueError, match="distinct keys"):
        mqar(0, 100_000, max_pairs() + 1)
    with pytest.raises(ValueError, match="at least"):
        passkey(0, 40, 0.5)
    assert suite("passkey", 0, [40, 200], [0.5], 2) == [passkey(0, 200, 0.5), passkey(1, 200, 0.5)]


def _decode_window(w: np.ndarray) -> tuple[str, list[str]]:
    """The window's text and the runs of loss-bearing characters (answers)."""
    text = "".join(chr(t & (NO_LOSS - 1)) for t in w)
    runs = re.findall(r"[^\x00]+", "".join(chr(t) if not t & NO_LOSS else "\x00" for t in w[1:]))
    return text, runs


def test_mqar_training_windows_train_only_answers_and_are_deterministic():
    tok = ByteTokenizer()
    train, val = MQARWindows(tok, 256, 0, 1, 12), MQARWindows(tok, 256, 0, 1, 12, split="val")
    assert np.array_equal(train[7], MQARWindows(tok, 256, 0, 1, 12)[7]) and not np.array_equal(train[7], val[7])
    for i in range(20):
        w = train[i]
        assert w.shape == (257,) and w.dtype == np.int32
        text, runs = _decode_window(w)
        context, *queries = text.split("\n")
        pairs = dict(re.findall(r"([A-Z]+):(\d+)\. ", context))
        full = [q for q in queries[:-1] if re.fullmatch(r"[A-Z]+:\d+", q)]  # the last may be cut
        assert full and all(pairs[k] == v for k, v in (q.split(":") for q in full))
        # the loss-bearing tokens are exactly the answers' digits (the last one may be cut short)
        assert runs == [q.split(":")[1] for q in queries if ":" in q and q.split(":")[1]]
    with pytest.raises(DataError, match="does not fit"):
        MQARWindows(tok, 64, 0, 1, 40)


def test_loss_counts_only_unflagged_targets():
    params = init_params(MICRO, jax.random.key(0))
    rng = np.random.default_rng(0)
    ids = rng.integers(1, 256, (2, 33)).astype(np.int32)
    keep = rng.random((2, 32)) < 0.3
    batch = ids.copy()
    batch[:, 1:] |= np.where(keep, 0, NO_LOSS).astype(np.int32)
    loss = jax.jit(loss_fn, static_argnums=0)
    got = float(loss(MICRO, params, batch))
    logits = jax.jit(forward, static_argnums=0)(MICRO, params, ids[:, :-1])
    logits = torch.tensor(np.asarray(logits), dtype=torch.float64)
    ce = torch.nn.functional.cross_entropy(
        logits.reshape(-1, 256), torch.tensor(ids[:, 1:]).reshape(-1).long(), reduction="none"
    )
    want = float(ce[torch.tensor(keep.reshape(-1))].mean())
    assert abs(got - want) <= 1e-5 * abs(want)
    assert abs(float(loss(MICRO, params, ids)) - float(ce.mean())) <= 1e-5 * float(ce.mean())


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
    guess = lambda ss: [str(rng.integers(100, 100000)) for _ in ss]  # noqa: E731
    assert max(r["accuracy"] for r in score(samples, guess).values()) <= 0.1  # chance is ~1e-3


def test_scoring_takes_the_exact_first_word():
    samples = suite("passkey", 0, [512], [0.5], 4)
    exact = [s.answer + "." for s in samples]
    longer = [" " + s.answer + "7" for s in samples]  # extra digits: wrong, though it starts right
    assert score(samples, lambda ss: exact)["512|0.5"]["accuracy"] == 1.0
    assert score(samples, lambda ss: longer)["512|0.5"]["accuracy"] == 0.0
    assert answer_token("  4821.\n") == "4821" and answer_token("") == ""


@pytest.mark.slow
def test_model_scorer_answers_are_the_models_greedy_tokens():
    """The engine's answers equal generate.sample's greedy continuation (independent decode loop)."""
    params = init_params(MICRO, jax.random.key(0))
    tok = ByteTokenizer()
    samples = suite("passkey", 0, [200, 400], [0.5], 2)
    serve = serve_config(max_num_seqs=2, prefill_chunk=64, max_model_len=1024)
    factory = lambda: Engine(MICRO, params, serve, eos_id=0)  # noqa: E731
    done, seen = [], []

    def answers(ss):
        out = model_answers(factory, tok, on_done=lambda: done.append(1))(ss)
        seen.extend(out)
        return out

    res = score(samples, answers)
    assert set(res) == {"200|0.5", "400|0.5"} and len(done) == len(samples)
    for s, text in zip(samples, seen, strict=True):
        n = len(tok.encode(s.answer))
        ids = sample(MICRO, params, tok.encode(s.prompt), n, temperature=0.0)
        ids = ids[: ids.index(0)] if 0 in ids else ids  # the engine stops at EOS (id 0) and does not emit it
        assert text == tok.decode(ids)
    for key, r in res.items():
        cell = [answer_token(t) == s.answer for s, t in zip(samples, seen, strict=True) if f"{s.length}|0.5" == key]
        assert r["accuracy"] == np.mean(cell)


@pytest.mark.slow
def test_numerics_report_bounds_on_a_tiny_model():
    params = init_params(MICRO, jax.random.key(0))
    tokens = np.random.default_rng(0).integers(1, 256, (2, 100)).astype(np.int32)
    rep = report(MICRO, params, tokens, decode_steps=8)
    assert rep["jit_vs_eager"]["rms_rel"] <= 1e-5
    assert rep["chunk_vs_recurrent"]["rms_rel"] <= 1e-4
    assert rep["fp32_vs_bf16"]["rms_rel"] <= 3e-2  # the bf16 bound in docs/kernels.md
    assert rep["jit_vs_eager_bf16"]["rms_rel"] <= 3e-2
    # the greedy comparison, recomputed through the serving engine (its own decode loop)
    g = rep["greedy_fp32_vs_bf16"]
    outs = {}
    for dtype in ("float32", "bfloat16"):
        cfg = dataclasses.replace(MICRO, dtype=dtype)
        eng = Engine(cfg, params, serve_config(max_num_seqs=1, prefill_chunk=64, max_model_len=1024), eos_id=-1)
        eng.warmup()
        outs[dtype] = []
        greedy = SamplingParams(max_tokens=8, temperature=0.0)
        eng.submit(Request(tokens[0].tolist(), greedy, lambda t, r, d=dtype: outs[d].extend(t)))
        eng.run_until_idle()
    same = [a == b for a, b in zip(outs["float32"], outs["bfloat16"], strict=True)]
    assert g["steps"] == 8 and g["agree"] == np.mean(same)
    assert g["first_divergence"] == (same.index(False) if False in same else None)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("m") / "micro"
    save_model(str(path), MICRO, init_params(MICRO, jax.random.key(0)))
    return str(path)


@pytest.mark.slow
def test_cli_numerics_and_perplexity(model_dir, tmp_path, capsys):
    out = str(tmp_path / "out")
    assert (
        eval_main(["numerics", "--checkpoint", model_dir, "--tokenizer", "byte", "--out", out, "--length", "64"]) == 0
    )
    rep = json.loads((tmp_path / "out" / "numerics.json").read_text())
    assert rep["jit_vs_eager"]["rms_rel"] <= 1e-5 and not rep["exact"]
    assert rep["jit_vs_eager_bf16"]["rms_rel"] > 1e-4  # without --exact the drift --exact removes is there
    docs = tmp_path / "docs.jsonl"
    docs.write_text(
        "".join(
            json.dumps({"text": f"{i}: " + "the quick brown fox jumps over the lazy dog. " * 40}) + "\n"
            for i in range(20)
        )
    )
    prepare([str(docs)], "byte", str(tmp_path / "data"), val_fraction=0.5, seed=0)
    capsys.readouterr()
    args = ["perplexity", "--checkpoint", model_dir, "--tokenizer", "byte", "--data", str(tmp_path / "data")]
    assert eval_main([*args, "--out", out, "--batches", "2"]) == 0
    m = re.search(
        r"loss ([\d.]+) nats/token, perplexity ([\d.]+), ([\d,]+) tokens, ([\d,]+) tokens/s", capsys.readouterr().out
    )
    assert m and abs(np.exp(float(m.group(1))) - float(m.group(2))) < 0.01 * float(m.group(2))
    assert eval_main([*args[:-1], str(tmp_path / "nodata"), "--out", out]) == 2
    assert "error:" in capsys.readouterr().err


def test_cli_recall_bad_input_is_a_clear_error(model_dir, tmp_path, capsys):
    base = ["recall", "--checkpoint", model_dir, "--tokenizer", "byte", "--out", str(tmp_path)]
    assert eval_main([*base, "--lengths", str(MICRO.max_seq_len + 1)]) == 2
    assert "max_seq_len" in capsys.readouterr().err
    assert eval_main([*base, "--levels", str(max_pairs() + 1)]) == 2
    assert f"[1, {max_pairs()}]" in capsys.readouterr().err
    assert eval_main([*base, "--suite", "passkey", "--levels", "1.5"]) == 2
    assert "depths in [0, 1]" in capsys.readouterr().err
    assert eval_main(["recall", "--checkpoint", model_dir, "--out", str(tmp_path)]) == 2
    assert "without a tokenizer" in capsys.readouterr().err
    assert eval_main([*base, "--lengths", "64", "--levels", "40"]) == 2  # 40 pairs cannot fit 64 tokens
    assert "no sample fits" in capsys.readouterr().err
    (tmp_path / "other.json").write_text('{"64|1": {"length": 64, "accuracy": 0.5}}')
    for bad in (tmp_path / "missing.json", tmp_path / "other.json"):
        assert eval_main([*base, "--compare", str(bad)]) == 2
        assert f"--compare {bad}: not a results file" in capsys.readouterr().err


@pytest.mark.slow
def test_cli_exact_sets_flags_and_removes_bf16_jit_drift(model_dir, tmp_path):
    """--exact needs a fresh process (XLA reads its flags once); the same report without it
    (test_cli_numerics_and_perplexity, in this process) shows the drift it removes."""
    out = tmp_path / "exact"
    cmd = [sys.executable, "-m", "laplace_jax.eval", "numerics", "--checkpoint", model_dir, "--tokenizer", "byte"]
    proc = subprocess.run([*cmd, "--out", str(out), "--length", "64", "--exact"], capture_output=True, text=True,
                          cwd=ROOT, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    rep = json.loads((out / "numerics_exact.json").read_text())
    assert "--xla_allow_excess_precision=false" in rep["xla_flags"]
    assert rep["jit_vs_eager"]["rms_rel"] <= 1e-5
    # no excess precision: compiled bf16 rounds where op-by-op does (measured: 0.0 vs 6.8e-3 on CPU)
    assert rep["jit_vs_eager_bf16"]["rms_rel"] <= 1e-6


@pytest.mark.slow
def test_short_recall_training_beats_chance(tmp_path):
    """recall_tiny through train.py, cut to CI size (64 tokens, 1-4 pairs, 300 steps), then the
    eval CLI at the training length. A 3-digit answer is guessed with probability ~1/900."""
    work = tmp_path / "recall"
    cmd = [sys.executable, "train.py", "--config", "configs/recall_tiny.py:1x", "--workdir", str(work)]
    cmd += ["--config.data.seq_len=64", "--config.data.mqar.max_pairs=4", "--config.train.steps=160"]
    cmd += ["--config.train.eval_every=0", "--config.train.ckpt_every=160", "--config.opt.warmup_steps=20"]
    env = child_env()  # one CPU device, as a user runs it
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = tmp_path / "eval"
    args = ["recall", "--checkpoint", str(work), "--suite", "mqar", "--lengths", "64", "--levels", "1", "2", "4"]
    assert eval_main([*args, "--samples", "16", "--out", str(out)]) == 0
    res = json.loads((out / "recall_mqar_recall.json").read_text())
    acc = np.mean([r["accuracy"] for r in res.values()])
    assert acc >= 0.3, res
    assert (out / "recall_mqar.png").stat().st_size > 0 and (out / "recall_mqar_curves.png").stat().st_size > 0


def test_data_source_typos_are_clear_errors():
    from laplace_jax.config import RunConfig
    from laplace_jax.data.sources import TrainingData
    from laplace_jax.defaults import base_config
    from laplace_jax.errors import UserError

    cfg = base_config()
    cfg.model.update(vocab_size=256, d_model=64, n_layers=1, n_heads=1)
    cfg.data.source = "mqr"
    with pytest.raises(UserError, match=r"data\.source must be one of 'text', 'mqar'; got 'mqr'"):
        RunConfig.from_mapping(cfg)
    cfg.data.update(source="mqar", seq_len=32)
    cfg.data.mqar.update(min_pairs=1, max_pairs=20)
    run = RunConfig.from_mapping(cfg)
    with pytest.raises(DataError, match=r"does not fit data\.seq_len=32"):
        TrainingData(run.data, run.model)
