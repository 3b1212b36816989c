"""Muon for hidden matrices + AdamW for everything else, as one ``optax.GradientTransformation``.

    tx = muon(3e-4, mesh=mesh, shard_axis="fsdp")      # distributed Newton-Schulz over "fsdp"
    tx = optax.inject_hyperparams(muon)(learning_rate=schedule)

Muon leaf update (torch.optim.Muon semantics): m <- beta m + (1 - beta) g; u = (1 - beta) g +
beta m (Nesterov) or m; p <- p - lr * scale(shape) * NS(u) - lr * wd * p. Leaves of rank > 2 are
batches of matrices over their leading axes (scanned layers): NS and the scale are per matrix,
with fan_in = shape[-2], fan_out = shape[-1] (flax [in, out] kernels).

Routing: regex rules on the parameter path ("layers/attn/q_proj/kernel"), first match wins,
unmatched leaves go to AdamW. By default embeddings, the LM head, norms, biases, short-conv
kernels and the GLA gate's low-rank pair (gk_proj_0/1) use AdamW.

With ``mesh``, each Muon matrix is split over ``shard_axis`` along whichever of its two axes
``param_specs`` (the parameters' PartitionSpecs) shards (rows by default); momentum, weight
decay and the update stay elementwise on shards and only Newton-Schulz moves data: two
all-to-alls per step (see ``newton_schulz.py``).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, PartitionSpec

from laplace_jax.config import ADJUST_LR, COMM_DTYPES
from laplace_jax.errors import ConfigError
from laplace_jax.optim.newton_schulz import distributed_newton_schulz, make_plan

DEFAULT_ROUTING: tuple[tuple[str, str], ...] = (
    (r"(^|/)(embeddings|lm_head)/", "adam"),
    (r"gk_proj", "adam"),
    (r"conv1d", "adam"),
    (r"/kernel$", "muon"),
)


def payload_dtype(name: str) -> jnp.dtype | None:
    """The Muon all-to-all payload for a config value (``config.COMM_DTYPES``), as ``comm_dtype``
    takes it (None: float32, the gradients' own dtype)."""
    if name not in COMM_DTYPES:
        raise ConfigError(f"opt.comm_dtype must be one of {', '.join(COMM_DTYPES)}; got {name!r}")
    return None if name == "float32" else jnp.dtype(name)


def path_str(path: tuple) -> str:
    parts = []
    for k in path:
        parts.append(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))))
    return "/".join(parts)


def label_params(params: Any, routing: Sequence[tuple[str, str]] = DEFAULT_ROUTING) -> Any:
    """'muon' or 'adam' for every leaf, by the first routing rule whose regex matches its path."""
    rules = [(re.compile(p), lab) for p, lab in routing]

    def label(path, x):
        name = path_str(path)
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise TypeError(f"parameter {name} has dtype {x.dtype}; Muon/AdamW need floating-point parameters")
        lab = next((lab for rx, lab in rules if rx.search(name)), "adam")
        if lab == "muon" and x.ndim < 2:
            raise ValueError(f"routing sends {name} (shape {x.shape}) to Muon, which needs a matrix (rank >= 2)")
        return lab

    return jax.tree_util.tree_map_with_path(label, params)


def lr_scale(fan_in: int, fan_out: int, adjust_lr: str) -> float:
    """Per-matrix update scale: 'original' sqrt(max(1, out/in)); 'match_rms_adamw' 0.2 sqrt(max(in, out))."""
    if adjust_lr == "original":
        return math.sqrt(max(1.0, fan_out / fan_in))
    return 0.2 * math.sqrt(max(fan_in, fan_out))


def _spec_table(param_specs: Any) -> dict[str, PartitionSpec]:
    if param_specs is None:
        return {}
    leaves = jax.tree_util.tree_leaves_with_path(param_specs, is_leaf=lambda x: isinstance(x, PartitionSpec))
    return {path_str(p): s for p, s in leaves}


class MuonState(NamedTuple):
    momentum: Any


def _split_axis(spec: PartitionSpec | None, ndim: int, shard_axis: str) -> int:
    """0 (row blocks) or 1 (column blocks): the matrix axis ``spec`` shards over ``shard_axis``."""
    entries = list(spec or ()) + [None] * ndim
    names = lambda e: e if isinstance(e, tuple) else (e,)  # noqa: E731
    return 1 if shard_axis in names(entries[ndim - 1]) and shard_axis not in names(entries[ndim - 2]) else 0


def orthogonalize(
    tree: Any,
    *,
    mesh: Mesh | None,
    shard_axis: str,
    specs: dict[str, PartitionSpec] | None = None,
    coeffs: Sequence[float],
    steps: int | jax.Array,
    eps: float,
    comm_dtype: jnp.dtype | None,
) -> Any:
    """NS of every matrix in ``tree`` (leaves [..., m, n]); distributed over ``shard_axis`` of ``mesh``."""
    with_path, treedef = jax.tree_util.tree_flatten_with_path(tree)
    if not with_path:
        return tree
    leaves = [x for _, x in with_path]
    N = 1 if mesh is None else mesh.shape[shard_axis]
    axes = [_split_axis((specs or {}).get(path_str(p)), x.ndim, shard_axis) for p, x in with_path]
    shapes, counts, split = [], [], []
    for x, ax in zip(leaves, axes, strict=True):
        batch = math.prod(x.shape[:-2])
        counts.append(batch)
        shapes += [x.shape[-2:]] * batch
        split += [ax] * batch
    plan = make_plan(shapes, N, split)
    kw = dict(coeffs=coeffs, steps=steps, eps=eps, comm_dtype=comm_dtype)

    def local(*blocks_per_leaf):
        blocks = []
        for x in blocks_per_leaf:
            blocks += list(x.reshape(-1, *x.shape[-2:]))
        out = distributed_newton_schulz(blocks, plan, axis_name=None if N == 1 else shard_axis, **kw)
        res, i = [], 0
        for x, c in zip(blocks_per_leaf, counts, strict=True):
            res.append(jnp.stack(out[i : i + c]).reshape(x.shape))
            i += c
        return tuple(res)

    f32 = [x.astype(jnp.float32) for x in leaves]
    if N == 1:
        out = local(*f32)
    else:
        dims = [x.ndim - 2 + ax for x, ax in zip(f32, axes, strict=True)]
        pads = [(-x.shape[d]) % N for x, d in zip(f32, dims, strict=True)]
        padded = [
            jnp.pad(x, [(0, p if i == d else 0) for i in range(x.ndim)])
            for x, d, p in zip(f32, dims, pads, strict=True)
        ]
        in_specs = tuple(
            PartitionSpec(*[shard_axis if i == d else None for i in range(x.ndim)])
            for x, d in zip(padded, dims, strict=True)
        )
        fn = jax.shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=in_specs, check_vma=False)
        with jax.named_scope("muon"):  # names its collectives in the HLO (hlo_stats.source_of)
            done = fn(*padded)
        out = [jax.lax.slice_in_dim(y, 0, y.shape[d] - p, axis=d) for y, d, p in zip(done, dims, pads, strict=True)]
    return jax.tree.unflatten(treedef, [y.astype(x.dtype) for y, x in zip(out, leaves, strict=True)])


def scale_by_muon(
    *,
    beta: float = 0.95,
    nesterov: bool = True,
    ns_coeffs: Sequence[float] = (3.4445, -4.7750, 2.0315),
    ns_steps: int = 5,
    eps: float = 1e-7,
    adjust_lr: str = "match_rms_adamw",
    mesh: Mesh | None = None,
    shard_axis: str = "fsdp",
    param_specs: Any = None,
    comm_dtype: jnp.dtype | None = None,
) -> optax.GradientTransformation:
    """Momentum + Newton-Schulz + per-matrix scale (no learning rate, no weight decay)."""
    specs = _spec_table(param_specs)

    def init_fn(params):
        return MuonState(jax.tree.map(jnp.zeros_like, params))

    def update_fn(updates, state, params=None):
        del params
        mom = jax.tree.map(lambda m, g: beta * m + (1 - beta) * g, state.momentum, updates)
        # jnp.where keeps ``nesterov`` usable as a traced hyperparameter (optax.inject_hyperparams).
        u = jax.tree.map(lambda m, g: jnp.where(nesterov, (1 - beta) * g + beta * m, m), mom, updates)
        o = orthogonalize(
            u,
            mesh=mesh,
            shard_axis=shard_axis,
            specs=specs,
            coeffs=ns_coeffs,
            steps=ns_steps,
            eps=eps,
            comm_dtype=comm_dtype,
        )
        o = jax.tree.map(lambda x: x * lr_scale(x.shape[-2], x.shape[-1], adjust_lr), o)
        return o, MuonState(mom)

    return optax.GradientTransformation(init_fn, update_fn)


def muon(
    learning_rate: optax.ScalarOrSchedule,
    *,
    beta: float = 0.95,
    nesterov: bool = True,
    ns_coeffs: Sequence[float] = (3.4445, -4.7750, 2.0315),
    ns_steps: int = 5,
    eps: float = 1e-7,
    weight_decay: float = 0.1,
    adjust_lr: str = "match_rms_adamw",
    adam_b1: float = 0.9,
    adam_b2: float = 0.95,
    adam_eps: float = 1e-8,
    adam_learning_rate: optax.ScalarOrSchedule | None = None,
    adam_weight_decay: float | None = None,
    routing: Sequence[tuple[str, str]] = DEFAULT_ROUTING,
    mesh: Mesh | None = None,
    shard_axis: str = "fsdp",
    param_specs: Any = None,
    comm_dtype: jnp.dtype | None = None,
) -> optax.GradientTransformation:
    """Muon (hidden matrices) + AdamW (the rest). Moonlight defaults: wd 0.1, AdamW (0.9, 0.95).

    ``adam_learning_rate`` / ``adam_weight_decay`` default to ``learning_rate`` / ``weight_decay``
    (with 'match_rms_adamw' the two optimizers share one lr and wd). ``param_specs``: the
    parameters' PartitionSpecs (a matching pytree), which tell each matrix's split axis. ``comm_dtype`` (e.g.
    jnp.bfloat16) sets the all-to-all payload dtype; NS itself runs in float32.
    """
    if adjust_lr not in ADJUST_LR:
        raise ValueError(f"adjust_lr must be one of {ADJUST_LR}; got {adjust_lr!r}")
    if mesh is not None and shard_axis not in mesh.axis_names:
        raise ValueError(f"shard_axis {shard_axis!r} is not an axis of the mesh (axes: {mesh.axis_names})")
    labels: Callable[[Any], Any] = lambda params: label_params(params, routing)  # noqa: E731
    muon_tx = optax.chain(
        scale_by_muon(
            beta=beta,
            nesterov=nesterov,
            ns_coeffs=ns_coeffs,
            ns_steps=ns_steps,
            eps=eps,
            adjust_lr=adjust_lr,
            mesh=mesh,
            shard_axis=shard_axis,
            param_specs=param_specs,
            comm_dtype=comm_dtype,
        ),
        optax.add_decayed_weights(weight_decay),
        optax.scale_by_learning_rate(learning_rate),
    )
    adam_tx = optax.adamw(
        learning_rate if adam_learning_rate is None else adam_learning_rate,
        b1=adam_b1,
        b2=adam_b2,
        eps=adam_eps,
        weight_decay=weight_decay if adam_weight_decay is None else adam_weight_decay,
    )
    return optax.partition({"muon": muon_tx, "adam": adam_tx}, labels)
