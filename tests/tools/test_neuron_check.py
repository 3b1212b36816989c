"""neuron_check: the programs a Neuron user runs, checked against JAX NeuronX's known issues."""

import jax
import jax.numpy as jnp
import numpy as np

from laplace_jax.tools import neuron_check
from laplace_jax.tools.neuron_check import findings


def _primitives(fn, *args) -> set[str]:
    return {f["primitive"] for f in findings(jax.make_jaxpr(fn)(*args).jaxpr, "probe")}


def test_every_known_issue_is_found_even_when_nested():
    x = jnp.ones((4,))
    assert _primitives(lambda x: jax.lax.cond(x[0] > 0, jnp.sin, jnp.cos, x), x) == {"cond"}
    assert _primitives(lambda x: jax.lax.while_loop(lambda c: c[0] < 3, lambda c: c + 1, x), x) == {"while"}
    assert _primitives(lambda x: jax.debug.print("{}", x) or x, x) & {"debug_callback", "debug_print"}
    callback = lambda x: jax.pure_callback(np.sin, jax.ShapeDtypeStruct((4,), x.dtype), x)  # noqa: E731
    assert "pure_callback" in _primitives(callback, x)
    assert _primitives(lambda x: jax.lax.reduce_precision(x, 5, 10), x) == {"reduce_precision"}
    assert _primitives(jnp.sort, x) == {"sort"}
    nested = lambda x: jax.lax.scan(lambda c, _: (jax.lax.cond(c[0] > 0, jnp.sin, jnp.cos, c), None), x, None, 2)[0]  # noqa: E731
    assert _primitives(nested, x) == {"cond"}
    threefry = _primitives(lambda k: jax.random.normal(k, (3,)), jax.random.key(0, impl="threefry2x32"))
    assert threefry and threefry <= {"random_bits", "random_wrap", "threefry2x32", "random_split", "random_fold_in"}
    assert _primitives(lambda k: jax.random.normal(k, (3,)), jax.random.key(0, impl="rbg")) == set()
    assert _primitives(lambda x: x.astype(jnp.complex64), x)


def test_every_program_is_clean_on_tiny_and_3b(capsys):
    """The train step (Muon's Newton-Schulz runs one program on every rank, no lax.switch),
    init, forward, prefill, decode and the sampler (lax.top_k, no sort): no finding, exit 0."""
    import json

    for config in ("configs/tiny.py", "configs/3b.py"):
        code = neuron_check.main(["--config", config, "--devices", "8", "--json"])
        found = json.loads(capsys.readouterr().out)
        assert set(found) == {"train_step", "init", "forward", "prefill", "decode", "sampling"}
        assert all(v == [] for v in found.values()), (config, found)
        assert code == 0


def test_threefry_is_reported_where_it_is_used(capsys):
    import json

    neuron_check.main(["--config", "configs/tiny.py", "--devices", "2", "--prng-impl", "threefry2x32", "--json"])
    found = json.loads(capsys.readouterr().out)
    for program in ("init", "sampling"):
        assert any("threefry" in f["issue"] for f in found[program]), program
    assert np.all([f["issue"].startswith("threefry") is False for f in found["decode"]])
