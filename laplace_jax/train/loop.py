"""The training run: mesh, data, compiled step, resume, metrics, checkpoints, eval, plots.

``run(config, workdir)`` trains (resuming from the newest checkpoint in ``workdir``);
``plan(config)`` compiles the sharded step for the config's mesh on fake CPU devices with
abstract inputs and reports memory and communication without allocating anything.
"""

from __future__ import annotations

import functools
import json
import os
import tempfile
import time
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from tqdm import tqdm

from laplace_jax import platform
from laplace_jax.checkpoint import TrainCheckpointer
from laplace_jax.cli import UserError
from laplace_jax.config import ModelConfig, model_config
from laplace_jax.data.corpus import embedded_documents
from laplace_jax.data.pipeline import WindowSource, array_windows, eval_batches, store_windows, train_batches
from laplace_jax.data.store import DataError, read_meta
from laplace_jax.data.synthetic import MQARWindows
from laplace_jax.data.tokenizer import load_tokenizer
from laplace_jax.hlo_stats import collective_bytes, collectives_by_source
from laplace_jax.models.gla_lm import abstract_params, count_params, init_params
from laplace_jax.sharding import AXES, batch_sharding, make_mesh, param_shardings, param_specs, replicated, rules
from laplace_jax.train.step import eval_step, flops_per_token, init_state, make_optimizer, train_step


def _config_dict(cfg: Any) -> dict:
    return json.loads(cfg.to_json_best_effort())


class Data:
    """Train windows, eval batches and tokenizer facts for a config."""

    def __init__(self, cfg: Any, model: ModelConfig):
        d = cfg.data
        self.train: WindowSource
        val: WindowSource
        if d.source not in ("text", "mqar"):
            raise UserError(f"data.source must be 'text' or 'mqar'; got {d.source!r}")
        if d.source == "mqar":
            tok = load_tokenizer(d.tokenizer)
            self.tokenizer, self.vocab_size, self.eos_id = tok.spec, tok.vocab_size, tok.eos_id
            args = (tok, d.seq_len, d.seed, d.mqar.min_pairs, d.mqar.max_pairs)
            self.train = MQARWindows(*args)
            val = MQARWindows(*args, split="val")
        elif d.path:
            meta = read_meta(d.path)
            self.tokenizer, self.vocab_size, self.eos_id = meta["tokenizer"], meta["vocab_size"], meta["eos_id"]
            self.train = store_windows(d.path, "train", d.seq_len)
            val = store_windows(d.path, "val", d.seq_len)
        else:
            tok = load_tokenizer(d.tokenizer)
            self.tokenizer, self.vocab_size, self.eos_id = tok.spec, tok.vocab_size, tok.eos_id
            tokens = embedded_tokens(tok.spec, d.embedded_max_chars)
            cut = int(len(tokens) * 0.98)
            self.train = array_windows(tokens[:cut], d.seq_len)
            val = array_windows(tokens[cut:], d.seq_len)
        if self.vocab_size > model.vocab_size:
            raise UserError(
                f"the data's tokenizer has {self.vocab_size} ids but model.vocab_size is {model.vocab_size}; "
                f"set --config.model.vocab_size={self.vocab_size} (or larger) or use matching data"
            )
        self.val = eval_batches(val, min(d.global_batch, 8), d.eval_batches)


@functools.lru_cache(maxsize=4)
def embedded_tokens(spec: str, max_chars: int) -> np.ndarray:
    """The embedded corpus as one flat token array (documents joined by EOS), cached per process."""
    tok = load_tokenizer(spec)
    parts = []
    for doc in embedded_documents(max_chars):
        parts += [np.asarray(tok.encode(doc), np.uint32), np.asarray([tok.eos_id], np.uint32)]
    return np.concatenate(parts)


def _check_workdir(workdir: str) -> None:
    try:
        os.makedirs(workdir, exist_ok=True)
        # A unique name: every process of a multi-host run probes the same shared workdir.
        with tempfile.NamedTemporaryFile(dir=workdir, prefix=".write_test_"):
            pass
    except OSError as e:
        raise UserError(
            f"workdir {workdir} is not writable ({e.strerror}); pass --workdir to a writable directory"
        ) from e


def _state_shardings(state_shapes: Any, param_shardings: Any, fallback: NamedSharding) -> Any:
    """Every state leaf that mirrors a parameter (its path ends with the parameter's path and the
    shapes match: params, Muon momentum, Adam moments) gets that parameter's sharding; scalars and
    anything else are replicated. XLA's own propagation would replicate optimizer state."""
    leaves = jax.tree_util.tree_leaves_with_path(param_shardings)
    by_path = dict(sorted(((jax.tree_util.keystr(p), s) for p, s in leaves), key=lambda kv: -len(kv[0])))

    def pick(path, leaf):
        key = jax.tree_util.keystr(path)
        for ppath, sharding in by_path.items():
            if key.endswith(ppath) and len(sharding.spec) <= leaf.ndim:
                return sharding
        return fallback

    return jax.tree_util.tree_map_with_path(pick, state_shapes)


class Setup:
    """Everything the step needs, with shardings; nothing allocated until ``init``/``restore``."""

    def __init__(self, cfg: Any, devices: list | None = None):
        self.cfg = cfg
        self.model = model_config(cfg)
        t = cfg.train
        if cfg.data.global_batch % t.grad_accum:
            raise UserError(
                f"data.global_batch {cfg.data.global_batch} is not divisible by train.grad_accum {t.grad_accum}"
            )
        self.steps = int(t.steps)
        self.mesh = make_mesh(cfg.mesh, devices)
        n_dev = self.mesh.devices.size
        micro = cfg.data.global_batch // t.grad_accum
        if micro % n_dev:
            raise UserError(
                f"micro-batch {micro} (global_batch / grad_accum) is not divisible by {n_dev} devices; "
                "change data.global_batch or train.grad_accum"
            )
        rule_set = rules(cfg)
        self.param_shardings = param_shardings(self.model, self.mesh, rule_set)
        self.tx, self.sched = make_optimizer(cfg.opt, self.steps, self.mesh, param_specs(self.model, rule_set))
        params_abs = jax.tree.map(
            lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
            abstract_params(self.model),
            self.param_shardings,
        )
        shapes = jax.eval_shape(functools.partial(init_state, tx=self.tx), params_abs)
        self.state_shardings = _state_shardings(shapes, self.param_shardings, replicated(self.mesh))
        init_fn = jax.jit(functools.partial(init_state, tx=self.tx), out_shardings=self.state_shardings)
        self.abstract_state = jax.tree.map(
            lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), shapes, self.state_shardings
        )
        self.batch_sharding = NamedSharding(self.mesh, P(None, AXES, None))
        seq = cfg.data.seq_len
        self.abstract_batch = jax.ShapeDtypeStruct(
            (t.grad_accum, micro, seq + 1), jnp.int32, sharding=self.batch_sharding
        )

        def step(state, batch):
            # The model's activation constraints use logical names; the rules bind them to the mesh
            # (set around lowering in ``compile``).
            with nn.logical_axis_rules(rule_set):
                return train_step(self.model, self.tx, self.sched, state, batch, self.param_shardings)

        self.step_fn = jax.jit(
            step,
            in_shardings=(self.state_shardings, self.batch_sharding),
            out_shardings=(self.state_shardings, replicated(self.mesh)),
            donate_argnums=0,
        )
        self._init_fn = init_fn
        self.n_params = count_params(abstract_params(self.model))
        self.tokens_per_step = cfg.data.global_batch * seq

    def compile(self):
        """AOT-compile the step (abstract inputs) and return the Compiled object."""
        with jax.set_mesh(self.mesh):
            return self.step_fn.lower(self.abstract_state, self.abstract_batch).compile()

    def init(self, seed: int) -> dict:
        params = jax.jit(lambda k: init_params(self.model, k), out_shardings=self.param_shardings)(jax.random.key(seed))
        return self._init_fn(params)


def memory_report(compiled) -> dict[str, int]:
    m = compiled.memory_analysis()
    need = m.argument_size_in_bytes + m.temp_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
    return {
        "arguments": int(m.argument_size_in_bytes),
        "outputs": int(m.output_size_in_bytes),
        "temporaries": int(m.temp_size_in_bytes),
        "aliased": int(m.alias_size_in_bytes),
        "total": int(need),
    }


def check_fit(mem: dict[str, int], available: int, n_devices: int) -> None:
    if mem["total"] > 0.95 * available:
        raise UserError(
            f"the train step needs {mem['total'] / 2**30:.1f} GiB per device (arguments "
            f"{mem['arguments'] / 2**30:.1f}, temporaries {mem['temporaries'] / 2**30:.1f}) but a device has "
            f"{available / 2**30:.1f} GiB ({n_devices} devices). Use more devices (mesh.fsdp), a smaller "
            "data.global_batch with train.grad_accum, model.remat=full (or save_gla), or inspect with --plan"
        )


def _fmt_bytes(b: float) -> str:
    return f"{b / 2**30:.2f} GiB"


def plan(cfg: Any) -> dict[str, Any]:
    """Compile the sharded step for the config's mesh on fake CPU devices; report memory and traffic."""
    from laplace_jax.optim.comm_report import muon_comm_report

    setup = Setup(cfg)
    compiled = setup.compile()
    mem = memory_report(compiled)
    n = setup.mesh.devices.size
    hlo = compiled.as_text()
    coll = collective_bytes(hlo)
    rep = {
        "devices": n,
        "mesh": dict(setup.mesh.shape),
        "params": setup.n_params,
        "tokens_per_step": setup.tokens_per_step,
        "total_steps": setup.steps,
        "total_tokens": setup.tokens_per_step * setup.steps,
        "memory_per_device": mem,
        "device_memory": platform.device_memory_bytes(cfg.train.device_memory_gib),
        "train_step_collectives_per_device": coll,
        "train_step_collectives_by_source": collectives_by_source(hlo),
    }
    if cfg.opt.optimizer == "muon" and setup.mesh.shape["fsdp"] > 1:
        comm = jnp.bfloat16 if cfg.opt.comm_dtype == "bfloat16" else None
        rep["muon"] = muon_comm_report(setup.model, setup.mesh.shape["fsdp"], comm)
    return rep


def format_plan(rep: dict[str, Any]) -> str:
    mem, avail = rep["memory_per_device"], rep["device_memory"]
    lines = [
        f"devices             {rep['devices']} (mesh {rep['mesh']})",
        f"parameters          {rep['params']:,}",
        f"tokens per step     {rep['tokens_per_step']:,}",
        f"total steps         {rep['total_steps']:,} ({rep['total_tokens'] / 1e9:.1f}e9 tokens)",
        "memory per device (compiled train step):",
        f"  arguments         {_fmt_bytes(mem['arguments'])}",
        f"  outputs           {_fmt_bytes(mem['outputs'])} ({_fmt_bytes(mem['aliased'])} aliased to inputs)",
        f"  temporaries       {_fmt_bytes(mem['temporaries'])}",
        f"  total             {_fmt_bytes(mem['total'])} of {_fmt_bytes(avail)} "
        f"({100 * mem['total'] / avail:.0f}%){'  DOES NOT FIT' if mem['total'] > avail else ''}",
        "collectives per device per step (trip counts applied):",
    ]
    for kind, v in rep["train_step_collectives_per_device"].items():
        if v["ops"]:
            lines.append(f"  {kind:<18}{v['ops']:>6.0f} ops  {v['bytes'] / 1e9:8.3f} GB")
            for src, by_kind in sorted(rep["train_step_collectives_by_source"].items()):
                if kind in by_kind and len(rep["train_step_collectives_by_source"]) > 1:
                    w = by_kind[kind]
                    lines.append(f"    from {src:<12}{w['ops']:>6.0f} ops  {w['bytes'] / 1e9:8.3f} GB")
    if "muon" in rep:
        m = rep["muon"]
        lines += [
            f"Muon all-to-alls    {m['all_to_all_bytes_per_rank'] / 1e9:.3f} GB/rank/step ({m['comm_dtype']}) vs "
            f"{m['gather_baseline_bytes_per_rank'] / 1e9:.2f} GB gather baseline: "
            f"{m['reduction_vs_gather']:.1f}x less; "
            f"NS busiest/mean rank {m['ns_busiest_over_mean']:.3f}"
        ]
    return "\n".join(lines)


class MetricsWriter:
    """JSONL (always) and TensorBoard event files (when tensorboardX is installed), process 0 only."""

    def __init__(self, workdir: str, enabled: bool):
        self.enabled = enabled
        self.path = os.path.join(workdir, "metrics.jsonl")
        self.tb = None
        if enabled:
            try:
                from tensorboardX import SummaryWriter

                self.tb = SummaryWriter(os.path.join(workdir, "tb"))
            except ImportError:
                self.tb = None

    def write(self, step: int, values: dict[str, float]) -> None:
        if not self.enabled:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps({"step": step, **values}) + "\n")
        if self.tb is not None:
            for k, v in values.items():
                self.tb.add_scalar(k, v, step)

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()


def plot_loss(workdir: str) -> str | None:
    """workdir/loss.png from metrics.jsonl (train and eval loss against step)."""
    path = os.path.join(workdir, "metrics.jsonl")
    if not os.path.exists(path):
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(path) as f:
        rows = [json.loads(line) for line in f]
    fig, ax = plt.subplots(figsize=(7, 4))
    train = [(r["step"], r["loss"]) for r in rows if "loss" in r]
    evals = [(r["step"], r["eval_loss"]) for r in rows if "eval_loss" in r]
    if train:
        ax.plot(*zip(*train, strict=True), label="train loss", lw=1)
    if evals:
        ax.plot(*zip(*evals, strict=True), "o-", label="eval loss")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.grid(alpha=0.3)
    ax.legend()
    out = os.path.join(workdir, "loss.png")
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def _same_run(saved: dict, current: dict) -> None:
    for section in ("model", "data"):
        a, b = saved.get(section), current.get(section)
        if a != b:
            diff = sorted(k for k in set(a or {}) | set(b or {}) if (a or {}).get(k) != (b or {}).get(k))
            raise UserError(
                f"the checkpoints in this workdir were written with a different {section} config (differs in: "
                f"{', '.join(diff)}); resume with the same config or pass a new --workdir"
            )


def run(
    cfg: Any, workdir: str, *, max_steps: int | None = None, devices: list | None = None, log=print
) -> dict[str, Any]:
    """Train (or resume) and return a summary. ``max_steps`` stops early; ``devices`` defaults to all."""
    _check_workdir(workdir)
    lead = jax.process_index() == 0
    setup = Setup(cfg, devices)
    model, t = setup.model, cfg.train
    try:
        data = Data(cfg, model)
    except (DataError, FileNotFoundError) as e:
        raise UserError(str(e)) from e
    compiled = setup.compile()
    mem = memory_report(compiled)
    check_fit(mem, platform.device_memory_bytes(t.device_memory_gib), setup.mesh.devices.size)
    batches = train_batches(
        data.train,
        global_batch=cfg.data.global_batch,
        seed=cfg.data.seed,
        num_steps=setup.steps,
        process_index=jax.process_index(),
        process_count=jax.process_count(),
    )
    data_iter = iter(batches)
    ckpt = TrainCheckpointer(workdir, keep=t.keep_checkpoints, every=t.ckpt_every)
    cfg_json = _config_dict(cfg)
    start = ckpt.latest_step()
    if start is not None:
        _same_run(ckpt.saved_config(start), cfg_json)
        state = ckpt.restore(start, setup.abstract_state, data_iter)
        log(f"resumed from step {start} in {ckpt.directory}")
    else:
        start = 0
        state = setup.init(cfg.data.seed)
    end = setup.steps if max_steps is None else min(setup.steps, max_steps)
    peak, peak_src = platform.peak_flops_per_device(t.peak_tflops)
    fpt = flops_per_token(model, setup.n_params)
    n_dev = setup.mesh.devices.size
    if lead:
        log(
            f"{setup.n_params:,} params | mesh {dict(setup.mesh.shape)} on {jax.devices()[0].platform} | "
            f"{setup.tokens_per_step:,} tokens/step | step memory {mem['total'] / 2**20:.0f} MiB/device | "
            f"peak {peak / 1e12:.3f} TFLOP/s/device ({peak_src})"
        )
    writer = MetricsWriter(workdir, lead)
    eval_fn = jax.jit(functools.partial(eval_step, model))
    eval_sharding = batch_sharding(setup.mesh)
    history: list[dict] = []

    def local_batch(x: np.ndarray) -> jax.Array:
        x = x.reshape(t.grad_accum, -1, x.shape[-1])
        return jax.make_array_from_process_local_data(setup.batch_sharding, x)

    def evaluate(params) -> float:
        losses = []
        for b in data.val:
            rows = b.shape[0] // jax.process_count()
            mine = b[jax.process_index() * rows : (jax.process_index() + 1) * rows]
            arr = jax.make_array_from_process_local_data(eval_sharding, mine) if b.shape[0] % n_dev == 0 else b
            losses.append(float(eval_fn(params, arr)))
        return float(np.mean(losses))

    clock = {"last": time.perf_counter()}

    def emit(step: int, m: dict) -> None:
        m = {k: float(v) for k, v in jax.device_get(m).items()}  # waits for that step only
        now = time.perf_counter()
        seconds, clock["last"] = now - clock["last"], now
        tps = setup.tokens_per_step / seconds if seconds > 0 else 0.0
        rec = {
            "loss": m["loss"],
            "grad_norm": m["grad_norm"],
            "update_norm": m["update_norm"],
            "lr": m["lr"],
            "tokens_per_s": tps,
            "mfu": fpt * tps / (peak * n_dev) if peak else 0.0,
            "step_s": seconds,
            "skipped": int(not m["finite"]),
        }
        history.append({"step": step, **rec})
        bar.set_postfix(loss=f"{rec['loss']:.3f}", tok_s=f"{tps:,.0f}", mfu=f"{100 * rec['mfu']:.1f}%")
        if step % t.log_every == 0 or step == end:
            writer.write(step, rec)
        if m["nonfinite"] >= t.max_nonfinite:
            raise UserError(
                f"{int(m['nonfinite'])} non-finite steps in a row at step {step} (loss {m['loss']}); the last good "
                f"state is checkpointed. Lower opt.lr or opt.clip_norm, or check the data; then resume"
            )

    bar = tqdm(total=end, initial=start, desc="train", unit="step", disable=not lead, mininterval=1.0)
    pending = None
    try:
        for step in range(start, end):
            batch = local_batch(next(data_iter))
            state, metrics = compiled(state, batch)
            if pending is not None:  # metrics of the previous step: no host stall on this one
                emit(*pending)
            pending = (step + 1, metrics)
            bar.update(1)
            ckpt.save(step + 1, state, data_iter, cfg_json)
            if t.eval_every and (step + 1) % t.eval_every == 0:
                writer.write(step + 1, {"eval_loss": evaluate(state["params"])})
        if pending is not None:
            emit(*pending)
    finally:
        bar.close()
        ckpt.wait()
    final_step = int(jax.device_get(state["step"]))
    ckpt.save(final_step, state, data_iter, cfg_json, force=final_step not in ckpt.manager.all_steps())
    eval_loss = evaluate(state["params"])
    writer.write(final_step, {"eval_loss": eval_loss})
    ckpt.wait()
    ckpt.close()
    writer.close()
    png = plot_loss(workdir) if lead else None
    summary = {
        "step": final_step,
        "eval_loss": eval_loss,
        "skipped": int(jax.device_get(state["skipped"])),
        "history": history,
        "loss_png": png,
        "workdir": os.path.abspath(workdir),
    }
    if lead:
        last = history[-1]["loss"] if history else float("nan")
        log(f"done: step {final_step}, train loss {last:.4f}, eval loss {eval_loss:.4f}; plot {png}")
    return summary
