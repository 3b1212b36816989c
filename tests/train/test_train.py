"""Training: golden step, learning, exact resume, device-count invariance, restore elsewhere, bad input."""

import json
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import child_env, micro_config, reference_value_and_grad

from laplace_jax.checkpoint import TrainCheckpointer, load_trained
from laplace_jax.errors import UserError
from laplace_jax.models.gla_lm import forward
from laplace_jax.train.loop import run
from laplace_jax.train.trainer import Trainer


def _quiet(*_):
    pass


def test_one_step_golden_values():
    """Pins loss, grad norm and update norm of step 1 (synthetic batch, seed 0, 1 device).

    May change only when the model, init, optimizer or XLA's CPU numerics change; update the
    numbers deliberately and say why in the commit.
    """
    cfg = micro_config()
    trainer = Trainer(cfg, jax.devices()[:1])
    state = trainer.init(0)
    batch = np.random.default_rng(0).integers(1, 256, (1, 8, 65)).astype(np.int32)
    _, m = trainer.compile()(state, jax.device_put(batch, trainer.batch_sharding))
    m = jax.device_get(m)
    assert float(m["loss"]) == pytest.approx(5.552062, abs=2e-5)  # ~ln(256) = 5.545: an untrained byte model
    assert float(m["grad_norm"]) == pytest.approx(GOLDEN_GRAD_NORM, rel=1e-3)
    assert float(m["update_norm"]) == pytest.approx(GOLDEN_UPDATE_NORM, rel=1e-3)


GOLDEN_GRAD_NORM = 0.5295795
GOLDEN_UPDATE_NORM = 0.1125118


def test_loss_decreases_on_embedded_corpus(tmp_path):
    out = run(micro_config(train=dict(steps=40)), str(tmp_path), devices=jax.devices()[:1], log=_quiet)
    losses = [h["loss"] for h in out["history"]]
    assert np.mean(losses[-5:]) < np.mean(losses[:5]) - 1.0
    assert os.path.exists(out["loss_png"])
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert {"loss", "grad_norm", "lr", "tokens_per_s", "mfu"} <= set(rows[0])


@pytest.mark.slow
@pytest.mark.usefixtures("compile_cache")  # the resume compiles nothing new
def test_resume_is_exact(tmp_path):
    cfg = micro_config(train=dict(steps=12, ckpt_every=4))
    straight = run(cfg, str(tmp_path / "a"), devices=jax.devices()[:1], log=_quiet)
    run(cfg, str(tmp_path / "b"), max_steps=8, devices=jax.devices()[:1], log=_quiet)
    resumed = run(cfg, str(tmp_path / "b"), devices=jax.devices()[:1], log=_quiet)
    a = {h["step"]: h["loss"] for h in straight["history"]}
    b = {h["step"]: h["loss"] for h in resumed["history"]}
    assert sorted(b) == list(range(9, 13))
    for s in b:
        assert a[s] == b[s], s  # bitwise on CPU, data order included
    _, _, pa = load_trained(str(tmp_path / "a"))
    _, _, pb = load_trained(str(tmp_path / "b"))
    jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)), pa, pb)


@pytest.mark.usefixtures("compile_cache")  # the resume compiles nothing new
def test_trains_on_prepared_shards_and_on_a_mixture_with_exact_resume(tmp_path):
    """data.path on a sharded dataset from prepare, and data.sources mixing it with mqar: 8 steps
    straight equal 4 steps, a stop, and a resume, bit for bit."""
    from laplace_jax.data.corpus import embedded_documents
    from laplace_jax.data.prepare import prepare

    with open(tmp_path / "docs.jsonl", "w") as f:
        for doc in embedded_documents(200_000):
            f.write(json.dumps({"text": doc}) + "\n")
    data = str(tmp_path / "data")
    prepare([str(tmp_path / "docs.jsonl")], "byte", data, val_fraction=0.1)
    for name, block in [
        ("shards", dict(path=data)),
        ("mixture", dict(sources=(f"{data}=0.8", "mqar=0.2"), mqar=dict(min_pairs=1, max_pairs=4))),
    ]:
        cfg = micro_config(data=block, train=dict(steps=8, ckpt_every=4))
        straight = run(cfg, str(tmp_path / name / "a"), devices=jax.devices()[:1], log=_quiet)
        run(cfg, str(tmp_path / name / "b"), max_steps=4, devices=jax.devices()[:1], log=_quiet)
        resumed = run(cfg, str(tmp_path / name / "b"), devices=jax.devices()[:1], log=_quiet)
        a = {h["step"]: h["loss"] for h in straight["history"]}
        assert [a[h["step"]] for h in resumed["history"]] == [h["loss"] for h in resumed["history"]], name
        assert [h["step"] for h in resumed["history"]] == [5, 6, 7, 8]


def test_four_devices_equal_one(tmp_path):
    cfg = micro_config(train=dict(steps=6))
    one = run(cfg, str(tmp_path / "one"), devices=jax.devices()[:1], log=_quiet)
    four = run(cfg, str(tmp_path / "four"), devices=jax.devices()[:4], log=_quiet)
    la = [h["loss"] for h in one["history"]]
    lb = [h["loss"] for h in four["history"]]
    np.testing.assert_allclose(la, lb, atol=1e-5)


@pytest.mark.slow
def test_checkpoint_from_4_devices_restores_on_1_in_fresh_process(tmp_path):
    cfg = micro_config(train=dict(steps=4))
    run(cfg, str(tmp_path), devices=jax.devices()[:4], log=_quiet)
    tokens = np.arange(1, 41, dtype=np.int32).reshape(2, 20)
    _, mcfg, params = load_trained(str(tmp_path))
    here = np.asarray(forward(mcfg, params, jnp.asarray(tokens)))
    code = (
        "import sys, numpy as np, jax.numpy as jnp; from laplace_jax.checkpoint import load_trained; "
        "from laplace_jax.models.gla_lm import forward; _, c, p = load_trained(sys.argv[1]); "
        "np.save(sys.argv[2], np.asarray(forward(c, p, jnp.asarray(np.arange(1, 41, dtype=np.int32).reshape(2, 20)))))"
    )
    env = child_env()
    subprocess.run([sys.executable, "-c", code, str(tmp_path), str(tmp_path / "l.npy")], check=True, env=env)
    np.testing.assert_allclose(np.load(tmp_path / "l.npy"), here, rtol=1e-6, atol=1e-6)


def test_a_step_too_big_for_the_device_stops_before_allocating(tmp_path):
    """check_fit, reached: 1 MiB of device memory cannot hold the micro model's step. The error gives
    the compiled need and what to change, and no checkpoint is written."""
    cfg = micro_config(mesh=dict(fsdp=1), train=dict(device_memory_gib=2**-10))
    with pytest.raises(UserError, match=r"the train step needs [\d.]+ GiB per device .* but a device has 0\.0 GiB"):
        run(cfg, str(tmp_path / "w"), devices=jax.devices()[:1], log=_quiet)
    assert not (tmp_path / "w" / "checkpoints").exists() or not os.listdir(tmp_path / "w" / "checkpoints")


def test_bad_input_is_reported(tmp_path):
    with pytest.raises(UserError, match="does not fit the 3 available"):
        Trainer(micro_config(mesh=dict(fsdp=4)), jax.devices()[:3])
    with pytest.raises(UserError, match="not writable"):
        ro = tmp_path / "ro"
        ro.mkdir()
        ro.chmod(0o500)
        if os.access(ro, os.W_OK):  # root ignores permissions; use a path under a file instead
            (tmp_path / "file").write_text("x")
            ro = tmp_path / "file" / "sub"
        run(micro_config(), str(ro), devices=jax.devices()[:1], log=_quiet)
    with pytest.raises(UserError, match="vocab_size"):
        run(micro_config(model=dict(vocab_size=100)), str(tmp_path / "v"), devices=jax.devices()[:1], log=_quiet)
    run(micro_config(train=dict(steps=2)), str(tmp_path / "w"), devices=jax.devices()[:1], log=_quiet)
    with pytest.raises(UserError, match="different model config"):
        run(micro_config(model=dict(d_model=32)), str(tmp_path / "w"), devices=jax.devices()[:1], log=_quiet)
    assert TrainCheckpointer(str(tmp_path / "w")).latest_step() == 2  # nothing overwritten


def test_train_cli_errors_are_clean(tmp_path):
    env = child_env()
    proc = subprocess.run(
        [
            sys.executable,
            "train.py",
            "--config",
            "configs/tiny.py",
            "--config.opt.learning_rate=1",
            "--workdir",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        env=env,
    )
    assert proc.returncode != 0 and "Traceback" not in proc.stderr and "learning_rate" in proc.stderr


MICRO_FLAGS = [
    "--config.model.d_model=64",
    "--config.model.chunk_size=16",
    "--config.model.max_seq_len=64",
    "--config.data.seq_len=64",
    "--config.data.global_batch=8",
    "--config.data.embedded_max_chars=300000",
    "--config.train.steps=4",
    "--config.train.log_every=1",
    "--config.train.eval_every=0",
    "--config.train.peak_tflops=1",
]


def _train_proc(workdir, n_devices, extra=()):
    env = child_env(n_devices)
    cmd = [sys.executable, "train.py", "--config", "configs/tiny.py", *MICRO_FLAGS, "--workdir", str(workdir), *extra]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _losses(workdir):
    return [r["loss"] for r in map(json.loads, (workdir / "metrics.jsonl").read_text().splitlines()) if "loss" in r]


@pytest.mark.slow
def test_two_processes_equal_one_process(tmp_path):
    import portpicker

    port = portpicker.pick_unused_port()
    procs = [
        _train_proc(
            tmp_path / "multi",
            2,
            ["--coordinator_address", f"127.0.0.1:{port}", "--num_processes", "2", "--process_id", str(i)],
        )
        for i in range(2)
    ]
    errs = [p.communicate(timeout=600)[1] for p in procs]
    for i, (p, err) in enumerate(zip(procs, errs, strict=True)):
        assert p.returncode == 0, f"process {i}:\n{err[-3000:]}\nprocess {1 - i}:\n{errs[1 - i][-1500:]}"
    single = _train_proc(tmp_path / "single", 4)  # after the pair: 2 cores, and Gloo waits only 30 s
    _, err = single.communicate(timeout=600)
    assert single.returncode == 0, err[-3000:]
    np.testing.assert_allclose(_losses(tmp_path / "multi"), _losses(tmp_path / "single"), atol=1e-5)


@pytest.mark.slow
def test_3b_plan_compiles_for_64_devices():
    env = child_env()
    proc = subprocess.run(
        [sys.executable, "train.py", "--config", "configs/3b.py", "--plan", "--json"],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rep = json.loads(proc.stdout)
    assert rep["devices"] == 64 and rep["params"] == 3_029_528_064
    assert rep["tokens_per_step"] == 524_288 and rep["total_steps"] == 190_735
    assert rep["gla_kernels"] == ["XLA chunk kernel (blocks layout)"]  # model.attn_impl=auto on this CPU host
    mem = rep["memory_per_device"]
    assert 0 < mem["total"] <= rep["device_memory"] == 24 * 2**30
    assert mem["arguments"] < 1 * 2**30  # params + optimizer state sharded 64 ways (~25.5 GB / 64)
    assert rep["muon"]["all_to_all_bytes_per_rank"] <= 0.23e9
    # the compiled train step moves what the Muon report says: 2 all-to-alls of the bf16 payload
    by_source = rep["train_step_collectives_by_source"]
    muon = by_source["muon"]["all-to-all"]
    assert muon["ops"] == 2
    assert abs(muon["bytes"] - rep["muon"]["all_to_all_bytes_per_rank"]) <= 0.01 * muon["bytes"]
    coll = rep["train_step_collectives_per_device"]
    assert coll["all-to-all"]["ops"] == 2  # Muon's two are the only ones
    # gradients leave the model as reduce-scatters to their shards: 3.03e9 fp32 / 64
    assert abs(coll["reduce-scatter"]["bytes"] - 4 * rep["params"] / 64) <= 0.01 * coll["reduce-scatter"]["bytes"]
    assert coll["all-reduce"]["bytes"] <= 10e6  # only the loss, norms and gains: never a full gradient
    assert mem["total"] <= 13.15 * 2**30
    cost = rep["cost"]
    assert cost["comm_s"] > 0 and 0 < cost["seed"]["mfu"] < 1
    assert cost["overlapped"]["tokens_per_s"] >= cost["serial"]["tokens_per_s"] > cost["seed"]["tokens_per_s"]
    assert rep["train_step_collectives_per_device"]["all-gather"]["bytes"] <= 11.6e9  # bf16 weight gathers


def test_3b_on_this_machine_stops_with_advice(tmp_path):
    env = child_env()
    proc = subprocess.run(
        [sys.executable, "train.py", "--config", "configs/3b.py", "--workdir", str(tmp_path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert "--plan" in proc.stderr and "64" in proc.stderr


def _collectives(hlo: str, kind: str) -> list[str]:
    return [line for line in hlo.splitlines() if f" {kind}(" in line]


@pytest.mark.slow
def test_fsdp_gradients_equal_one_device_and_leave_as_reduce_scattered_shards():
    """fp32 on a 2 (data) x 4 (fsdp) mesh: the loss and every parameter's gradient equal the
    one-device ones, and in the compiled HLO each weight's gradient leaves the model as a
    reduce-scatter to its shard (one per all-gather); the only all-reduces are small (the loss,
    the replicated norm gains and the data-axis sum of the shards)."""
    import flax.linen as nn

    from laplace_jax.data.synthetic import NO_LOSS
    from laplace_jax.models.gla_lm import init_params
    from laplace_jax.sharding import make_mesh, param_shardings, param_specs
    from laplace_jax.train.step import fsdp_value_and_grad

    cfg = micro_config(mesh=dict(data=2, fsdp=4))
    model, rule_set = cfg.model, cfg.mesh.rules
    mesh = make_mesh(cfg.mesh, jax.devices()[:8])
    params = init_params(model, jax.random.key(0))
    batch = np.random.default_rng(0).integers(1, 256, (8, 65)).astype(np.int32)
    batch[:3, :40] |= NO_LOSS  # uneven target counts per device: the mean must still be global
    ref_loss, ref_grads = reference_value_and_grad(model)(params, batch)

    fn = jax.jit(fsdp_value_and_grad(model, mesh, param_specs(model, rule_set)))
    with jax.set_mesh(mesh), nn.logical_axis_rules(rule_set):
        sharded = jax.device_put(params, param_shardings(model, mesh, rule_set))
        rows = jax.device_put(batch, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(("data", "fsdp"))))
        compiled = fn.lower(sharded, rows).compile()
        loss, grads = compiled(sharded, rows)
    assert abs(float(loss) - float(ref_loss)) <= 1e-6 * abs(float(ref_loss))
    for (path, g), r in zip(jax.tree.leaves_with_path(grads), jax.tree.leaves(ref_grads), strict=True):
        err = float(jnp.max(jnp.abs(g - r)))
        assert err <= 1e-5 * float(jnp.max(jnp.abs(r))) + 1e-9, (jax.tree_util.keystr(path), err)

    hlo = compiled.as_text()
    gathers, scatters = _collectives(hlo, "all-gather"), _collectives(hlo, "reduce-scatter")
    assert len(gathers) >= 15 and len(scatters) == len(gathers)
    assert all(re.search(r"= f32\[", line) for line in scatters)
    from laplace_jax.hlo_stats import collective_bytes

    coll = collective_bytes(hlo)
    param_bytes = 4 * sum(x.size for x in jax.tree.leaves(params))
    # norm gains and the data-axis sum of the shards (1/4 of the params): nowhere near a full all-reduce
    assert coll["all-reduce"]["bytes"] <= 0.3 * param_bytes, (coll, param_bytes)


@pytest.mark.slow
def test_fsdp_weights_are_gathered_in_bf16():
    """bf16 compute on 8 fake devices: every weight all-gather in the compiled step carries a
    16-bit payload (XLA:CPU sees it as uint16) except the gate bias (fp32); gradients go back
    as fp32 reduce-scatters."""
    cfg = micro_config(mesh=dict(fsdp=8), model=dict(dtype="bfloat16"))
    hlo = Trainer(cfg, jax.devices()[:8]).compile().as_text()
    gathers = [line for line in _collectives(hlo, "all-gather") if "GLALM" in line]
    wide = [line for line in gathers if not re.search(r"= \(?u16\[", line)]
    assert len(gathers) >= 15 and all("gk_proj_1" in line for line in wide), wide
    scatters = _collectives(hlo, "reduce-scatter")
    assert len(scatters) == len(gathers) and all(re.search(r"= f32\[", line) for line in scatters)
