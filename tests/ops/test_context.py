"""Context parallelism on fake CPU devices: the kernel and the model with each sequence split
across devices equal one device (outputs, final states, every gradient), the config refuses
what cannot split, training equals one device, and the compiled step's context traffic is a few
states per layer whatever the sequence length."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import micro_config, reference_value_and_grad, sharded_value_and_grad
from jax.sharding import PartitionSpec as P

from laplace_jax.data.synthetic import NO_LOSS
from laplace_jax.errors import ConfigError, UserError
from laplace_jax.hlo_stats import collectives_by_source
from laplace_jax.models.gla_lm import init_params
from laplace_jax.ops.gla import chunk_gla, context_gla
from laplace_jax.train.loop import run
from laplace_jax.train.trainer import Trainer

TOL = 1e-5  # relative to the largest reference value, fp32


def _rel(a, b) -> float:
    return float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b)))


def _inputs(lo: float, B=2, T=256, H=2, K=16, V=32, seed=0):
    """q, k, v, log-decays uniform in [lo, 0] nats/token, and an initial state."""
    r = np.random.default_rng(seed)
    q, k = (jnp.asarray(r.normal(size=(B, T, H, K)), jnp.float32) for _ in range(2))
    v = jnp.asarray(r.normal(size=(B, T, H, V)), jnp.float32)
    g = jnp.asarray(r.uniform(lo, 0.0, size=(B, T, H, K)), jnp.float32)
    s0 = jnp.asarray(r.normal(size=(B, H, K, V)), jnp.float32)
    return q, k, v, g, s0


def _objective(f, *args):
    o, s = f(*args)
    return jnp.sum(o * jnp.sin(o)) + jnp.sum(s * jnp.cos(s))  # every output and state element matters


@pytest.mark.parametrize("slices", [2, 4, 8])
@pytest.mark.parametrize("lo", [-0.01, -0.5, -16.0])
def test_context_kernel_equals_one_device(slices, lo):
    """Outputs, the final state and the gradients of q, k, v, g and the initial state, from a
    256-token sequence split over 2, 4 or 8 devices, equal the one-device kernel's within 1e-5
    relative, at log-decays down to -0.01, -0.5 and -16 nats/token."""
    args = _inputs(lo)
    one = functools.partial(lambda *a: chunk_gla(*a[:4], initial_state=a[4], chunk_size=16))
    mesh = jax.make_mesh((slices,), ("c",), devices=jax.devices()[:slices], axis_types=(jax.sharding.AxisType.Auto,))
    seq = P(None, "c")
    split = jax.shard_map(
        lambda q, k, v, g, s0: context_gla(q, k, v, g, axis="c", initial_state=s0, chunk_size=16),
        mesh=mesh, in_specs=(seq,) * 4 + (P(),), out_specs=(seq, P()), check_vma=False,
    )  # fmt: skip
    for got, want in zip(jax.jit(split)(*args), one(*args), strict=True):
        assert _rel(got, want) <= TOL
    grads = jax.jit(jax.grad(functools.partial(_objective, split), argnums=range(5)))(*args)
    ref = jax.grad(functools.partial(_objective, one), argnums=range(5))(*args)
    for name, got, want in zip(["q", "k", "v", "g", "s0"], grads, ref, strict=True):
        assert _rel(got, want) <= TOL, name


def _strong_decay(params, bias: float):
    """Every layer's gate bias set to ``bias``: log-decay log_sigmoid(bias) / normalizer per token."""

    def set_bias(path, x):
        name = jax.tree_util.keystr(path)
        return jnp.full_like(x, bias) if "gk_proj_1" in name and "bias" in name else x

    return jax.tree_util.tree_map_with_path(set_bias, params)


MESHES = [
    dict(data=1, fsdp=1, context=2),
    dict(data=1, fsdp=4, context=2),
    dict(data=2, fsdp=1, context=4),
    dict(data=1, fsdp=2, context=4),
    dict(data=1, fsdp=1, context=8),
]


@pytest.mark.parametrize("mesh_kw", MESHES, ids=lambda m: "x".join(f"{k}{v}" for k, v in m.items()))
@pytest.mark.parametrize("gate_bias", [None, -16.0 * 16])
def test_context_model_loss_and_gradients_equal_one_device(mesh_kw, gate_bias):
    """The whole micro model (short conv, GLA, MLP, loss with uneven targets) under context
    parallelism, with and without FSDP: the loss and every parameter's gradient equal the
    one-device ones within 1e-5 relative, at the initial gates and at -16 nats/token (gate bias
    -256 over the normalizer 16)."""
    cfg = micro_config(mesh=mesh_kw, data=dict(seq_len=128), model=dict(max_seq_len=128))
    model = cfg.model
    params = init_params(model, jax.random.key(0))
    if gate_bias is not None:
        params = _strong_decay(params, gate_bias)
    batch = np.random.default_rng(0).integers(1, 256, (8, 129)).astype(np.int32)
    batch[:3, 20:90] |= NO_LOSS  # targets counted unevenly across slices and rows
    ref_loss, ref_grads = reference_value_and_grad(model)(params, batch)
    loss, grads, _ = sharded_value_and_grad(cfg, int(np.prod(list(mesh_kw.values()))), params, batch)
    assert abs(float(loss) - float(ref_loss)) <= TOL * abs(float(ref_loss))
    for (path, g), r in zip(jax.tree.leaves_with_path(grads), jax.tree.leaves(ref_grads), strict=True):
        assert float(jnp.max(jnp.abs(g - r))) <= TOL * float(jnp.max(jnp.abs(r))) + 1e-12, jax.tree_util.keystr(path)


def test_context_config_refuses_what_cannot_split():
    with pytest.raises(ConfigError, match=r"data.seq_len \(96\) must be a multiple of context x model.chunk_size = 64"):
        micro_config(mesh=dict(context=4), data=dict(seq_len=96))
    micro_config(mesh=dict(context=4), data=dict(seq_len=128), model=dict(max_seq_len=128))  # 4 slices of 2 chunks
    with pytest.raises(ConfigError, match="runs the chunk kernels"):
        micro_config(mesh=dict(context=2), model=dict(attn_impl="recurrent"))
    with pytest.raises(ConfigError, match=r"mesh\.context must be >= 1"):
        micro_config(mesh=dict(context=0))
    with pytest.raises(UserError, match=r"data=1 x fsdp=2 x context=2 does not fit the 8"):
        Trainer(micro_config(mesh=dict(fsdp=2, context=2)), jax.devices()[:8])
    with pytest.raises(UserError, match="not divisible by data x fsdp = 8"):
        Trainer(micro_config(mesh=dict(fsdp=8, context=1), data=dict(global_batch=4)), jax.devices()[:8])


def test_context_training_equals_one_device(tmp_path):
    """Six steps of train.py's loop on 2 (fsdp) x 2 (context) devices: the losses of one device."""
    cfg = micro_config(train=dict(steps=6), mesh=dict(fsdp=2, context=2))
    split = run(cfg, str(tmp_path / "split"), devices=jax.devices()[:4], log=lambda *_: None)
    one = run(micro_config(train=dict(steps=6)), str(tmp_path / "one"), devices=jax.devices()[:1], log=lambda *_: None)
    np.testing.assert_allclose([h["loss"] for h in split["history"]], [h["loss"] for h in one["history"]], atol=1e-5)


def _context_collectives(seq_len: int, slices: int) -> tuple[dict, dict]:
    cfg = micro_config(mesh=dict(fsdp=2, context=slices), data=dict(seq_len=seq_len), model=dict(max_seq_len=seq_len))
    hlo = Trainer(cfg, jax.devices()[: 2 * slices]).compile().as_text()
    return collectives_by_source(hlo), cfg.model


@pytest.mark.slow
def test_context_traffic_is_states_per_layer_whatever_the_length():
    """The compiled train step at 128 and 512 tokens per sequence over 4 context slices: per layer
    and device one all-gather of the 4 slices' states (P - 1 = 3 received) and one reduce-scatter
    back, [rows, H, K, V + 1] fp32 each; the short convolutions' neighbour exchanges carry their
    last 4 inputs; every collective's bytes are the same at both lengths (nothing
    activation-sized crosses a device)."""
    short, model = _context_collectives(128, 4)
    long, _ = _context_collectives(512, 4)
    assert short == long
    ctx = short["context"]
    rows = 8 // 2  # global_batch over fsdp
    H, K, V, L = model.n_heads, model.head_k_dim, model.head_v_dim, model.n_layers
    state = rows * H * K * (V + 1) * 4  # [rows, H, K, V + 1] fp32: the state and its decay column
    gather, scatter, permute = ctx["all-gather"], ctx["reduce-scatter"], ctx["collective-permute"]
    assert (gather["ops"], gather["bytes"]) == (L, L * 4 * state)  # the gathered result: 4 slices
    assert abs(gather["wire"] / L - 3 * state) <= 0.01 * 3 * state  # (P - 1) x (state + decay) x 4 bytes
    assert (scatter["ops"], scatter["bytes"]) == (L, L * state)  # backward: each device's own slice
    conv = rows * model.conv_size * (2 * model.key_dim + model.value_dim) * 4  # q, k, v taps, fp32
    assert (permute["ops"], permute["bytes"]) == (2 * 3 * L, 2 * L * conv)  # forward and back
    assert set(ctx) == {"all-gather", "reduce-scatter", "collective-permute"}
