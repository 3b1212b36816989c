"""A tiny byte-level GLA model trained on the MQAR recall mixture (issue 6's recipe, CPU, minutes).

    python train.py --config configs/recall_tiny.py:1x --workdir runs/recall_1x   # 4 heads
    python train.py --config configs/recall_tiny.py:4x --workdir runs/recall_4x   # 1 head: 4x the state
    python -m laplace_jax.eval recall --checkpoint runs/recall_1x runs/recall_4x --suite mqar \
        --lengths 128 256 512 1024 2048 4096 8192 --levels 1 2 4 8 16 32 64 128 256

Same parameters in both; only the recurrent state differs. GLA's per-layer state is
n_heads x (key_dim / n_heads) x (value_dim / n_heads) = key_dim x value_dim / n_heads, so one
head holds 4x what four heads hold. Trained at 128 tokens with 1-12 pairs; the eval asks how far
that recall carries to longer contexts and more pairs.

The hybrid pair (docs/hybrid.md): ``:hybrid`` makes layer 1 softmax attention over a 256-token
window, ``:control`` is the same model all GLA (0.7% more parameters: a GLA layer's gate and
conv weights); both at 512 tokens with 1-48 pairs, the same data, batch and steps:

    python train.py --config configs/recall_tiny.py:hybrid --workdir runs/recall_hybrid
    python train.py --config configs/recall_tiny.py:control --workdir runs/recall_control
"""

from laplace_jax.defaults import base_config

STATES = {"1x": 4, "4x": 1, "hybrid": 4, "control": 4}  # variant -> n_heads
WINDOW = 256  # the hybrid's attention window (tokens)


def get_config(state: str = "1x"):
    if state not in STATES:
        raise ValueError(f"recall_tiny takes :1x or :4x (state size), or :hybrid / :control; got {state!r}")
    c = base_config()
    c.model.update(
        vocab_size=256,
        d_model=128,
        n_layers=2,
        n_heads=STATES[state],
        use_short_conv=True,
        chunk_size=64,
        max_seq_len=8192,
    )
    c.data.update(source="mqar", seq_len=128, global_batch=32, eval_batches=4)
    c.data.mqar.update(min_pairs=1, max_pairs=12)
    c.opt.update(lr=3e-3, warmup_steps=50)
    c.train.update(steps=800, log_every=10, eval_every=200, ckpt_every=200)
    if state in ("hybrid", "control"):
        c.data.update(seq_len=512, global_batch=16)
        c.data.mqar.update(min_pairs=1, max_pairs=48)
        c.train.update(steps=800, eval_every=200, ckpt_every=200)
        if state == "hybrid":
            c.model.attn = dict(layers=[1], num_heads=4, window_size=WINDOW)
    return c
