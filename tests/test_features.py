"""Features a user relies on that had no test: each test fails when its feature is broken.

grad accumulation, the wsd schedule, AdamW alone, the non-finite skip and stop, tokenizer.json
loading, sharded safetensors import."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from helpers import micro_config
from safetensors.torch import save_file

from laplace_jax.convert import load_fla
from laplace_jax.errors import UserError
from laplace_jax.optim.from_config import make_schedule
from laplace_jax.train.loop import run
from laplace_jax.train.trainer import Trainer


def _one_step(cfg, batch):
    trainer = Trainer(cfg, jax.devices()[:1])
    state = trainer.init(0)
    before = jax.device_get(state)  # the step donates its input state
    new, m = trainer.compile()(state, jax.device_put(batch, trainer.batch_sharding))
    return before, jax.device_get(new), jax.device_get(m)


def test_grad_accumulation_equals_the_whole_batch():
    """2 micro-batches of 4 == 1 batch of 8 (no padding, so every micro-batch has the same
    target count and the mean of means is the mean): same loss, same gradient norm, same step."""
    rows = np.random.default_rng(0).integers(1, 256, (8, 65)).astype(np.int32)
    _, whole, m1 = _one_step(micro_config(), rows.reshape(1, 8, 65))
    _, accum, m2 = _one_step(micro_config(train=dict(grad_accum=2)), rows.reshape(2, 4, 65))
    assert float(m2["loss"]) == pytest.approx(float(m1["loss"]), rel=1e-6)
    assert float(m2["grad_norm"]) == pytest.approx(float(m1["grad_norm"]), rel=1e-5)
    for a, b in zip(jax.tree.leaves(accum["params"]), jax.tree.leaves(whole["params"]), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


def test_wsd_schedule_warms_up_holds_then_decays_linearly():
    cfg = micro_config(opt=dict(schedule="wsd", lr=1.0, warmup_steps=5, min_lr_ratio=0.1, decay_fraction=0.2))
    sched = make_schedule(cfg.opt, 20)
    lr = [float(sched(s)) for s in range(20)]  # step s uses the schedule at s + 1
    decay = 4  # 20 * 0.2 steps, from 1.0 down to 0.1; 20 - 5 - 4 = 11 flat steps between
    want = [(s + 1) / 5 for s in range(4)] + [1.0] * 12 + [1.0 - 0.9 * k / decay for k in range(1, 5)]
    np.testing.assert_allclose(lr, want, rtol=1e-6)


def test_adamw_alone_takes_the_first_adam_step():
    """optimizer="adamw": step 1 of Adam is lr * g / (|g| + eps) on the clipped gradient, plus
    decoupled weight decay (lr * wd * p); computed here by hand, not by optax."""
    opt = dict(optimizer="adamw", lr=1e-2, warmup_steps=0, weight_decay=0.1, clip_norm=1e9, eps=1e-8)
    cfg = micro_config(opt=opt)
    batch = np.random.default_rng(1).integers(1, 256, (1, 8, 65)).astype(np.int32)
    state, new, _ = _one_step(cfg, batch)
    from laplace_jax.loss import loss_fn

    grads = jax.grad(lambda p: loss_fn(cfg.model, p, jnp.asarray(batch[0])))(state["params"])
    lr = float(make_schedule(cfg.opt, cfg.train.steps)(0))
    checked = 0
    for p0, g, p1 in zip(*(jax.tree.leaves(t) for t in (state["params"], grads, new["params"])), strict=True):
        p0, g = np.asarray(p0, np.float64), np.asarray(g, np.float64)
        want = p0 - lr * g / (np.abs(g) + 1e-8) - lr * 0.1 * p0
        # where |g| ~ eps, g / (|g| + eps) amplifies the last-bit differences of two gradient
        # computations: compare exactly away from it, and bound the step (<= lr) everywhere
        clear = np.abs(g) > 1e-6
        np.testing.assert_allclose(np.asarray(p1)[clear], want[clear], rtol=2e-4, atol=1e-6)
        assert np.all(np.abs(np.asarray(p1) - p0 * (1 - lr * 0.1)) <= lr * (1 + 1e-5))
        checked += int(clear.sum())
    assert checked > 0.5 * sum(x.size for x in jax.tree.leaves(grads))


def test_a_nonfinite_step_is_skipped_and_a_run_of_them_stops_the_run(tmp_path):
    cfg = micro_config()
    trainer = Trainer(cfg, jax.devices()[:1])
    state = trainer.init(0)
    head = state["params"]["lm_head"]["kernel"]  # every logit row reads it: the loss turns NaN
    state["params"]["lm_head"]["kernel"] = head.at[0, 0].set(jnp.nan)
    batch = np.random.default_rng(0).integers(1, 256, (1, 8, 65)).astype(np.int32)
    before = jax.device_get(state)
    new, m = trainer.compile()(state, jax.device_put(batch, trainer.batch_sharding))
    assert not bool(m["finite"]) and int(new["nonfinite"]) == 1 and int(new["skipped"]) == 1
    for a, b in zip(jax.tree.leaves(new["params"]), jax.tree.leaves(before["params"]), strict=True):
        np.testing.assert_array_equal(a, b)  # the bad update was not applied
    # a learning rate that blows the weights up: every step after the first is non-finite
    bad = micro_config(opt=dict(optimizer="adamw", lr=1e30, warmup_steps=0), train=dict(steps=20, max_nonfinite=3))
    with pytest.raises(UserError, match="3 non-finite steps in a row"):
        run(bad, str(tmp_path), devices=jax.devices()[:1], log=lambda *_: None)


def test_tokenizer_json_loads_and_round_trips(tmp_path):
    """A real ``tokenizers`` BPE model saved as tokenizer.json (what prepared data records)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = __import__("tokenizers").decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(["the quick brown fox jumps over the lazy dog"] * 50, trainer)
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    from laplace_jax.data.tokenizer import load_tokenizer

    loaded = load_tokenizer(str(path))
    assert loaded.eos_id == tok.token_to_id("<|endoftext|>")
    for text in ("the quick brown fox", "naïve café ✓ 日本", "tabs\tand\nnewlines"):
        ids = loaded.encode(text)
        assert ids == tok.encode(text, add_special_tokens=False).ids
        assert loaded.decode(ids) == text
    with pytest.raises(FileNotFoundError, match="not found"):
        load_tokenizer(str(tmp_path / "missing.json"))


def test_sharded_safetensors_import_equals_the_single_file(tmp_path):
    from fla_files import fla_config, write_fla_checkpoint

    c = fla_config(use_short_conv=True)
    model = write_fla_checkpoint(tmp_path / "single", c)
    sd = {k: v.contiguous() for k, v in model.state_dict().items()}
    names = sorted(sd)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    for fname, keys in shards.items():
        save_file({k: sd[k] for k in keys}, str(sharded / fname))
    weight_map = {k: f for f, keys in shards.items() for k in keys}
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (sharded / "config.json").write_text(json.dumps(c))
    _, p1 = load_fla(str(tmp_path / "single"))
    _, p2 = load_fla(str(sharded))
    for a, b in zip(jax.tree.leaves(p1), jax.tree.leaves(p2), strict=True):
        np.testing.assert_array_equal(a, b)
    assert torch.equal(
        torch.from_numpy(np.asarray(jax.tree.leaves(p2)[0])), torch.from_numpy(np.asarray(jax.tree.leaves(p1)[0]))
    )
