"""Muon vs optax.contrib.muon and torch.optim.Muon; distributed == single device; routing; errors."""

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from laplace_jax import ModelConfig, init_params
from laplace_jax.optim import label_params, muon
from laplace_jax.optim.newton_schulz import distributed_newton_schulz, make_plan


def _run(tx, params, grads_fn, steps=10):
    state = tx.init(params)

    @jax.jit
    def step(p, s, i):
        u, s = tx.update(grads_fn(p, i), s, p)
        return optax.apply_updates(p, u), s

    for i in range(steps):
        params, state = step(params, state, i)
    return params


def _quad_grads(targets):
    """Gradient of 0.5 * ||p - target||^2 plus a step-dependent perturbation (deterministic)."""

    def grads(p, i):
        return jax.tree.map(lambda x, t: (x - t) + 0.1 * jnp.sin(x * (i + 1)), p, targets)

    return grads


def _params(seed=0):
    r = np.random.default_rng(seed)
    return {
        "w1": jnp.asarray(r.standard_normal((16, 40)), jnp.float32),
        "w2": jnp.asarray(r.standard_normal((48, 12)), jnp.float32),
        "b": jnp.asarray(r.standard_normal((12,)), jnp.float32),
    }


def test_matches_optax_contrib_muon():
    params = _params()
    targets = jax.tree.map(lambda x: x * 0.5 + 1.0, params)
    routing = ((r"^w", "muon"),)
    ours = muon(0.02, nesterov=False, weight_decay=0.0, adjust_lr="original", adam_b2=0.999, routing=routing, eps=1e-8)
    dims = {"w1": optax.contrib.MuonDimensionNumbers(0, 1), "w2": optax.contrib.MuonDimensionNumbers(0, 1), "b": None}
    # optax's Adam side is NAdam when nesterov=True; with nesterov=False both sides match plain AdamW(wd=0).
    ref = optax.contrib.muon(0.02, nesterov=False, muon_weight_dimension_numbers=dims, eps=1e-8)
    a = _run(ours, params, _quad_grads(targets))
    b = _run(ref, params, _quad_grads(targets))
    for k in params:
        assert float(jnp.max(jnp.abs(a[k] - b[k]))) <= 1e-6, k


def _torch_ns_fp32(grad, ns_coefficients, ns_steps, eps):
    a, b, c = ns_coefficients
    x = grad.float()
    tall = x.size(0) > x.size(1)
    if tall:
        x = x.T
    x = x / x.norm().clamp(min=eps)
    for _ in range(ns_steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if tall else x


@pytest.mark.parametrize("nesterov", [False, True])
@pytest.mark.parametrize("adjust_lr", ["original", "match_rms_adamw"])
def test_matches_torch_muon_on_least_squares(monkeypatch, nesterov, adjust_lr):
    import torch.optim._muon as torch_muon

    monkeypatch.setattr(torch_muon, "_zeropower_via_newtonschulz", _torch_ns_fp32)
    r = np.random.default_rng(1)
    X = r.standard_normal((64, 24)).astype(np.float32)
    Y = r.standard_normal((64, 40)).astype(np.float32)
    W0 = (0.1 * r.standard_normal((40, 24))).astype(np.float32)  # torch layout [out, in]
    lr, wd = 0.02, 0.1

    w = torch.nn.Parameter(torch.from_numpy(W0.copy()))
    opt = torch.optim.Muon([w], lr=lr, weight_decay=wd, nesterov=nesterov, adjust_lr_fn=adjust_lr)
    for _ in range(10):
        opt.zero_grad()
        loss = 0.5 * ((torch.from_numpy(X) @ w.T - torch.from_numpy(Y)) ** 2).mean()
        loss.backward()
        opt.step()
    w_torch = w.detach().numpy().T  # -> flax [in, out]

    params = {"kernel": jnp.asarray(W0.T)}
    tx = muon(lr, weight_decay=wd, nesterov=nesterov, adjust_lr=adjust_lr, routing=((r"kernel", "muon"),))
    grad_fn = jax.grad(lambda p: 0.5 * jnp.mean((X @ p["kernel"] - Y) ** 2))
    out = _run(tx, params, lambda p, i: grad_fn(p))["kernel"]
    displacement = np.max(np.abs(w_torch - W0.T))
    assert np.max(np.abs(np.asarray(out) - w_torch)) <= 1e-5 * max(displacement, 1e-12) + 1e-7


def _mesh(n=8):
    return jax.make_mesh((n,), ("fsdp",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:n])


def _dist_params():
    r = np.random.default_rng(2)
    # tall, wide, rows % 8 != 0, and "e" sharded by columns
    shapes = {"a": (3, 40, 24), "b": (24, 70), "c": (100, 16), "d": (5, 13, 9), "e": (2, 12, 48)}
    p = {k: {"kernel": jnp.asarray(r.standard_normal(s), jnp.float32)} for k, s in shapes.items()}
    p["norm"] = {"weight": jnp.ones((7,))}
    return p


def _specs(tree):
    def spec(path, x):
        if "'e'" in jax.tree_util.keystr(path):
            return P(None, None, "fsdp")
        return P(*([None] * (x.ndim - 2)), "fsdp", None) if x.ndim >= 2 and x.shape[-2] % 8 == 0 else P()

    return jax.tree_util.tree_map_with_path(spec, tree)


def _shard(mesh, tree):
    return jax.tree.map(lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), tree, _specs(tree))


@pytest.mark.parametrize("comm_dtype", [None, jnp.bfloat16])
def test_distributed_equals_single_device(comm_dtype):
    params = _dist_params()
    targets = jax.tree.map(lambda x: -x, params)
    single = _run(muon(0.01), params, _quad_grads(targets))
    mesh = _mesh()
    tx = muon(0.01, mesh=mesh, comm_dtype=comm_dtype, param_specs=_specs(params))
    dist = _run(tx, _shard(mesh, params), _quad_grads(targets))
    tol = 1e-6 if comm_dtype is None else 2e-3
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(single), jax.tree.leaves(dist), strict=True):
        assert float(jnp.max(jnp.abs(a - b))) <= tol, jax.tree_util.keystr(path)


@pytest.mark.parametrize("comm_dtype", [None, jnp.bfloat16])
def test_compiled_update_has_two_all_to_alls_and_no_all_gather(comm_dtype):
    """Two all-to-alls; compiled for this CPU host, a bf16 payload crosses as pairs of its bits in
    uint32 words (XLA:CPU widens 16-bit float collectives; a program for a TPU sends bf16 itself:
    tests/test_tpu.py), 2 bytes an element either way."""
    # Fan-in divisible by the mesh, as for every hidden matrix of the configs (replicated leaves
    # with padded rows are exact too, see above, but their result is re-replicated by a gather).
    r = np.random.default_rng(3)
    shapes = {"a": (3, 40, 24), "b": (24, 70), "c": (64, 16), "d": (2, 8, 96), "e": (3, 20, 32)}
    params = {k: {"kernel": jnp.asarray(r.standard_normal(s), jnp.float32)} for k, s in shapes.items()}
    mesh = _mesh()
    tx = muon(0.01, mesh=mesh, param_specs=_specs(params), comm_dtype=comm_dtype)
    sharded = _shard(mesh, params)
    state = tx.init(sharded)
    hlo = jax.jit(tx.update).lower(sharded, state, sharded).compile().as_text()
    exchanges = [line.split(" all-to-all(")[0] for line in hlo.splitlines() if " all-to-all(" in line]
    assert len(exchanges) == 2
    assert "all-gather" not in hlo
    elements = sum(math.prod(s) for s in shapes.values()) // mesh.size  # this rank's blocks
    for result in exchanges:  # (XLA:CPU splits an all-to-all's buffer into one operand per rank)
        parts = re.findall(r"(\w+)\[([\d,]+)\]", result)
        assert {dtype for dtype, _ in parts} == {"f32" if comm_dtype is None else "u32"}
        words = sum(math.prod(int(d) for d in dims.split(",")) for _, dims in parts)
        payload = words * (1 if comm_dtype is None else 2)  # elements: a word holds two bf16 values
        assert elements <= payload <= 2 * elements  # this rank's blocks, and the buffer's padding


def test_a_bf16_exchange_moves_whole_slabs_in_bf16():
    """With a 16-bit wire every array the exchange pads, joins, slices or reshapes is 16-bit (the
    blocks are cast before they are packed and the results after they are sliced out), and no
    reshape regroups elements (a TPU relayouts each one: the buffer holds a block as its column
    slabs, stacked). The values are those of casting at the wire: NS of the bf16-rounded matrices."""
    r = np.random.default_rng(4)
    shapes, split = [(16, 24), (24, 16), (32, 8)], [0, 1, 0]
    blocks = [jnp.asarray(r.standard_normal(s), jnp.float32) for s in shapes]
    plan = make_plan(shapes, 1, split)
    assert plan.lanes == 8  # narrow blocks: a narrow row, so (16, 24) takes three slabs
    kw = dict(axis_name=None, coeffs=(3.4445, -4.7750, 2.0315), steps=5, eps=1e-7)
    fn = lambda bs: distributed_newton_schulz(bs, plan, comm_dtype=jnp.bfloat16, **kw)  # noqa: E731
    moves = ("reshape", "concatenate", "pad", "dynamic_slice", "dynamic_update_slice", "slice", "squeeze")
    eqns = [e for e in jax.make_jaxpr(fn)(blocks).jaxpr.eqns if e.primitive.name in moves]
    floats = lambda vs: [v.aval for v in vs if hasattr(v, "aval") and jnp.issubdtype(v.aval.dtype, jnp.floating)]  # noqa: E731
    moved = [a.dtype for e in eqns for a in floats((*e.invars, *e.outvars))]
    assert moved and set(moved) == {jnp.dtype(jnp.bfloat16)}
    for e in eqns:
        if e.primitive.name == "reshape" and floats(e.invars):
            assert [d for d in e.invars[0].aval.shape if d != 1] == [d for d in e.outvars[0].aval.shape if d != 1]
    rounded = [b.astype(jnp.bfloat16).astype(jnp.float32) for b in blocks]
    want = distributed_newton_schulz(rounded, plan, comm_dtype=None, **kw)
    for got, exp in zip(fn(blocks), want, strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(exp.astype(jnp.bfloat16).astype(jnp.float32)))


def test_routing_of_the_model_tree():
    cfg = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=2, use_short_conv=True)
    labels = label_params(init_params(cfg, jax.random.key(0)))
    flat = {jax.tree_util.keystr(p): lab for p, lab in jax.tree_util.tree_leaves_with_path(labels)}
    muon_keys = {k for k, lab in flat.items() if lab == "muon"}
    expected = {f"['layers']['attn']['{n}_proj']['kernel']" for n in "qkvgo"}
    expected |= {f"['layers']['mlp']['{n}_proj']['kernel']" for n in ("gate", "up", "down")}
    assert muon_keys == expected
    for k in flat:
        if any(s in k for s in ("embeddings", "lm_head", "norm", "bias", "conv1d", "gk_proj")):
            assert flat[k] == "adam", k


def test_works_with_inject_hyperparams_and_schedules():
    params = _params()
    sched = optax.warmup_cosine_decay_schedule(0.0, 0.02, 3, 10)
    tx = optax.inject_hyperparams(muon)(learning_rate=sched, routing=((r"^w", "muon"),))
    grads = _quad_grads(jax.tree.map(jnp.zeros_like, params))
    out = _run(tx, params, grads, steps=4)
    plain = _run(muon(sched, routing=((r"^w", "muon"),)), params, grads, steps=4)
    for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(plain), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)  # the injected schedule is the one used
    assert not np.allclose(out["w1"], params["w1"])


def test_bad_inputs():
    with pytest.raises(ValueError, match="not an axis of the mesh"):
        muon(0.1, mesh=_mesh(), shard_axis="data")
    with pytest.raises(ValueError, match="adjust_lr"):
        muon(0.1, adjust_lr="nope")
    tx = muon(0.1)
    with pytest.raises(TypeError, match="floating-point"):
        tx.init({"step": jnp.zeros((3, 3), jnp.int32)})
    with pytest.raises(ValueError, match="needs a matrix"):
        muon(0.1, routing=((r".", "muon"),)).init({"b": jnp.zeros((3,))})


def test_plan_is_balanced_for_3b():
    shapes = []
    for _ in range(24):
        shapes += [(3072, 1536)] * 2 + [(3072, 3072)] * 3 + [(3072, 8192)] * 2 + [(8192, 3072)]
    plan = make_plan(shapes, 64)
    loads = plan.rank_flops()
    assert max(loads) / (sum(loads) / 64) <= 1.25
    assert sorted(set(plan.owner)) == list(range(64))
    # one program for all ranks: each shape group takes ceil(count / 64) slots, no more
    slots = {shape: len(per_rank[0]) for shape, per_rank in plan.slots().items()}
    assert slots == {(3072, 3072, 0): 2, (3072, 1536, 0): 1, (3072, 8192, 0): 1, (8192, 3072, 0): 1}
    assert plan.executed_flops() / (sum(loads) / 64) <= 1.8  # 72 square matrices take 2 slots on all 64 ranks


@pytest.mark.parametrize("n_ranks", [4, 16, 64])
def test_the_3b_exchange_is_whole_256_wide_rows_with_no_padded_columns(n_ranks):
    """The 3B's matrices as the model shards them (o_proj and down_proj by columns): every block,
    a column block as rows of its transpose, is a whole number of 256-wide rows, so the buffer
    is the blocks themselves plus the busiest owner's share over the mean (the segment)."""
    shapes, split = [], []
    for _ in range(24):
        shapes += [(3072, 1536)] * 2 + [(3072, 3072)] * 2 + [(3072, 8192)] * 2 + [(3072, 3072), (8192, 3072)]
        split += [0] * 6 + [1, 1]
    plan = make_plan(shapes, n_ranks, split)
    assert plan.lanes == 256
    for block, rows, _ in plan.layout():
        assert block[1] % 256 == 0 and rows == block[0] * block[1] // 256
    held = [sum(m * n // n_ranks for i, (m, n) in enumerate(plan.shapes) if plan.owner[i] == o) for o in range(n_ranks)]
    assert plan.segment * plan.lanes == max(held)
