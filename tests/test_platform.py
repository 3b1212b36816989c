"""``platform``'s device questions on the devices JAX hands out: concrete, and abstract as JAX
0.10.2 and the Neuron floor (0.10.0, whose abstract device names no platform) spell them."""

import dataclasses

import jax

from laplace_jax.platform import compile_target, two_core_tpu


@dataclasses.dataclass(frozen=True)
class _FloorAbstractDevice:
    """JAX 0.10.0's abstract device: a kind and a core count, no platform."""

    device_kind: str
    num_cores: int | None


def test_two_core_tpu_on_every_spelling_of_a_device():
    assert not two_core_tpu(jax.devices()[0])  # this host's CPU
    assert not two_core_tpu(compile_target(jax.numpy.zeros(3)))
    assert two_core_tpu(_FloorAbstractDevice("TPU v5p", 2))
    assert two_core_tpu(_FloorAbstractDevice("TPU v4", 2))
    assert not two_core_tpu(_FloorAbstractDevice("TPU v5 lite", 1))
    assert not two_core_tpu(_FloorAbstractDevice("TPU v6 lite", None))
    assert not two_core_tpu(_FloorAbstractDevice("cpu", None))
    assert not two_core_tpu(_FloorAbstractDevice("NVIDIA H100 80GB HBM3", None))


def test_skip_unless_branches_where_a_cond_is_taken_and_runs_the_work_on_neuron():
    """``skip_unless``: a ``lax.cond`` in a program for this CPU (the work skipped when the
    predicate is false); in a program for Neuron, whose compiler takes no ``lax.cond``, the work
    itself and no conditional."""
    import jax.numpy as jnp

    from laplace_jax.platform import only_for, skip_unless

    def f(x):
        return skip_unless(jnp.any(x > 0), lambda x: x * 2, lambda x: x, x)

    x = jnp.asarray([-1.0, 3.0])
    assert "cond" in str(jax.make_jaxpr(f)(x))
    assert jax.jit(f)(x).tolist() == [-2.0, 6.0] and jax.jit(f)(-abs(x)).tolist() == [-1.0, -3.0]
    with only_for("neuron"):
        jaxpr = str(jax.make_jaxpr(lambda x: f(x))(x))  # a new function: traces are cached per function
    assert "cond" not in jaxpr and "mul" in jaxpr
