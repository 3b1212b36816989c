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
