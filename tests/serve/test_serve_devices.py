"""The engine over 8 fake CPU devices: slots sharded on a ``data`` axis, one SPMD program per bucket."""

import threading
import time

import jax
from serving_helpers import CFG, PARAMS, TOK, reference_greedy, serve_config

from laplace_jax.serve.engine import Engine
from laplace_jax.serve.metrics import ServeMetrics
from laplace_jax.serve.request import Request, SamplingParams

PROMPTS = [f"request {i}: " + "abc" * (i % 4) for i in range(20)]


def engine(devices: int, **kw) -> Engine:
    kw = {"max_num_seqs": 2, "prefill_chunk": 16, "steps_per_call": 3, "max_model_len": 512, **kw}
    eng = Engine(CFG, PARAMS, serve_config(devices=devices, **kw), eos_id=TOK.eos_id, metrics=ServeMetrics())
    eng.warmup()
    return eng


def serve_staggered(eng: Engine) -> dict[int, list[int]]:
    """Submit PROMPTS from another thread at staggered times while the engine loop runs; greedy."""
    outs: dict[int, list[int]] = {i: [] for i in range(len(PROMPTS))}
    done = threading.Semaphore(0)

    def emit(i):
        def f(tokens, reason):
            outs[i].extend(tokens)
            if reason:
                done.release()

        return f

    loop = threading.Thread(target=eng.loop, daemon=True)
    loop.start()
    for i, p in enumerate(PROMPTS):
        eng.submit(Request(TOK.encode(p), SamplingParams(max_tokens=6 + 3 * (i % 5), temperature=0), emit(i)))
        time.sleep(0.01 * (i % 3))
    for _ in PROMPTS:
        assert done.acquire(timeout=300)
    eng.stop()
    loop.join(30)
    return outs


def admit_all(eng):
    """Engine steps until one admits nothing (that step decodes the live slots once)."""
    while eng.step().admission is not None:
        pass


def test_eight_devices_equal_one_device_token_for_token():
    assert len(jax.devices()) >= 8
    one, eight = engine(1), engine(8)
    out1, out8 = serve_staggered(one), serve_staggered(eight)
    assert out8 == out1
    for i, p in enumerate(PROMPTS[:6]):
        assert out8[i] == reference_greedy(TOK.encode(p), 6 + 3 * (i % 5)), i
    assert eight.compiles.total("serving") == 0  # JAX's own compile events, after warmup
    assert eight.compiles.total("warmup") > 0
    # one executable per bucket: the decode programs span all 8 devices
    ex = eight.programs.get("decode", 2)
    assert len(ex.input_shardings[0][1]["model"][0]["gla"].device_set) == 8


def test_requests_go_to_the_least_loaded_device_and_compact_per_device():
    eng = engine(4, max_num_seqs=3, decode_buckets="3")
    long = SamplingParams(max_tokens=400, ignore_eos=True, temperature=0)
    reqs = [Request(TOK.encode(f"x{i}"), long, lambda *_: None) for i in range(6)]
    for r in reqs:
        eng.submit(r)
    admit_all(eng)
    assert eng.occupancy() == [2, 2, 1, 1]  # one per device per round, least-loaded first
    reqs[0].cancelled = True  # device 0, slot 0: its last live slot moves into the hole
    eng.step()  # reaps it, then decodes
    assert eng.occupancy() == [1, 2, 1, 1]
    assert eng.scheduler.slots.rows[0] == [reqs[4]]
    eng.submit(Request(TOK.encode("new"), long, lambda *_: None))
    admit_all(eng)
    assert eng.occupancy() == [2, 2, 1, 1]  # devices 0, 2, 3 tie at 1: the lowest index wins


def test_a_moved_slot_keeps_decoding_its_own_sequence():
    """Compaction on one device must carry the state: cancel a request mid-way on a 4-device engine,
    the survivors still produce the reference greedy tokens."""
    eng = engine(4, max_num_seqs=2, decode_buckets="2")
    outs = {i: [] for i in range(8)}
    greedy = SamplingParams(max_tokens=15, temperature=0)
    reqs = [Request(TOK.encode(PROMPTS[i]), greedy, lambda t, r, i=i: outs[i].extend(t)) for i in range(8)]
    for r in reqs:
        eng.submit(r)
    admit_all(eng)  # then one decode call
    reqs[0].cancelled = True
    eng.run_until_idle()
    for i in range(1, 8):
        assert outs[i] == reference_greedy(TOK.encode(PROMPTS[i]), 15), i


def test_serve_py_refuses_more_devices_than_there_are(tmp_path, capsys):
    import serve
    from laplace_jax.checkpoint import save_model

    save_model(str(tmp_path / "m"), CFG, PARAMS)
    rc = serve.main(["--checkpoint", str(tmp_path / "m"), "--tokenizer", "byte", "--devices", "99"])
    assert rc == 2
    assert f"--devices must lie in 1..{len(jax.local_devices())}" in capsys.readouterr().err


def test_rbg_keys_sample_reproducibly_and_greedy_is_unchanged():
    """serve.py --prng-impl rbg (Neuron's default): a seeded request repeats itself, and greedy
    decoding equals the model's own recurrent path."""
    from serving_helpers import TOK, Running, reference_greedy

    srv = Running(prng_impl="rbg", max_num_seqs=2)
    try:
        c = srv.client()
        runs = [
            c.completions.create(model="tiny", prompt="abc", max_tokens=12, temperature=1.0, seed=7).choices[0].text
            for _ in range(2)
        ]
        greedy = c.completions.create(model="tiny", prompt="abc", max_tokens=12, temperature=0.0).choices[0].text
    finally:
        srv.close()
    assert runs[0] == runs[1]
    assert greedy == TOK.decode(reference_greedy(TOK.encode("abc"), 12))
    assert srv.engine.programs.slots["rows"]["key"].shape[-1] == 4


def test_weights_are_placed_per_device_kind():
    """Serving's placement: bf16 layer weights as uint16 bits on CPU, each layer in buffers of its
    own on a two-core TPU (the same values, one tuple entry per layer; a vector that is not whole
    128-lane tiles as a [1, w] row, the Mosaic row kernels' form), as they are on a one-core TPU
    and other devices."""
    from types import SimpleNamespace

    import jax.numpy as jnp
    import numpy as np

    from laplace_jax.serve.programs import placed_weights

    bf16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16), PARAMS)
    kinds = [("cpu", None), ("tpu", 2), ("tpu", 1), ("gpu", 132)]
    cpu, tpu, v5e, gpu = (placed_weights(CFG, bf16, SimpleNamespace(platform=p, num_cores=n)) for p, n in kinds)
    assert {x.dtype for x in jax.tree.leaves(cpu["layers"])} == {jnp.dtype(jnp.uint16)}
    assert isinstance(tpu["layers"], tuple) and len(tpu["layers"]) == CFG.n_layers
    for r, layer in enumerate(tpu["layers"]):
        for a, b in zip(jax.tree.leaves(layer), jax.tree.leaves(bf16["layers"]), strict=True):
            row = b.ndim == 2 and b.shape[1] % 128 != 0  # a vector per layer, narrower than lane tiles
            assert a.shape == ((1, b.shape[1]) if row else b.shape[1:]), (a.shape, b.shape)
            assert np.array_equal(np.asarray(a).reshape(b.shape[1:]), np.asarray(b[r]))
    assert gpu is bf16 and v5e is bf16
