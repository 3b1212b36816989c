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


def test_model_programs_are_clean_on_tiny_and_3b(capsys):
    """init, forward, prefill and decode have no finding; what remains is reported, not hidden:
    the distributed Newton-Schulz's lax.switch over owner ranks and the sampler's float sort."""
    for config in ("configs/tiny.py", "configs/3b.py"):
        code = neuron_check.main(["--config", config, "--devices", "8", "--json"])
        out = capsys.readouterr().out
        import json

        found = json.loads(out)
        for program in ("init", "forward", "prefill", "decode"):
            assert found[program] == [], (config, program, found[program])
        assert code == (1 if any(found.values()) else 0)
        assert [f["primitive"] for f in found["train_step"]] == ["cond"]
        assert "newton_schulz.py" in found["train_step"][0]["where"]


def test_threefry_is_reported_where_it_is_used(capsys):
    import json

    neuron_check.main(["--config", "configs/tiny.py", "--devices", "2", "--prng-impl", "threefry2x32", "--json"])
    found = json.loads(capsys.readouterr().out)
    for program in ("init", "sampling"):
        assert any("threefry" in f["issue"] for f in found[program]), program
    assert np.all([f["issue"].startswith("threefry") is False for f in found["decode"]])
