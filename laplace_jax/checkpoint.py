"""Checkpoints (Orbax); this module owns every read and write of model state.

* A *model directory* holds ``config.json`` ({"model": ModelConfig fields}) and ``params/``
  (float32 parameters): what ``laplace_jax.convert`` writes and inference loads on one device.
* A *training workdir* holds ``checkpoints/<step>/`` written by ``TrainCheckpointer``: one
  Orbax CheckpointManager (async, keep-N, interval) with three items: ``state`` (params,
  optimizer state, step, counters), ``data`` (the grain iterator position) and ``config`` (the
  full run config as JSON). Orbax finalises a step directory only when every item is written,
  so an interrupted save is never restored.

Every finished checkpoint (a training step, a model's ``params/``) also gets ``checksums.json``:
a CRC-32 and the size of each of its files, computed from the bytes on disk once Orbax
has finalised it (in a background thread for training). Every read verifies them first, so a
bit flip, zeroed bytes that still decode, a truncated or deleted file and a missing commit marker
are all caught before any value is used. Resuming a run tries the newest step; a damaged one is
named in one line, moved aside to ``<step>.corrupt`` (never deleted) and the next older one is
tried. Loaders for inference refuse a damaged step and name the flag that picks another.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import zlib
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import grain
import jax
import numpy as np
import orbax.checkpoint as ocp

from laplace_jax.config import ModelConfig
from laplace_jax.errors import CheckpointError, ConfigError
from laplace_jax.models.gla_lm import abstract_params

CHECKSUMS = "checksums.json"
_CHUNK = 1 << 22
_WORKERS = min(16, os.cpu_count() or 1)
# what a read error says when the bytes themselves are bad (TensorStore / zstd / JSON), as
# opposed to a config or topology mismatch, which must never make a checkpoint look damaged
_CORRUPTION = re.compile(r"corrupt|checksum|decompress|DATA_LOSS|truncat|unexpected end|Expecting value", re.I)


def _digest(path: str) -> str:
    """CRC-32 of a file (zlib: ~7 GB/s a core here, 5x BLAKE2b): it detects accidental damage,
    which is what a checkpoint meets (bit flips, zeroed or lost bytes), not deliberate forgery."""
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return f"{crc:08x}"


def _digests(directory: str, files: list[str]) -> list[str]:
    with ThreadPoolExecutor(_WORKERS) as pool:
        return list(pool.map(lambda f: _digest(os.path.join(directory, f)), files))


def _files(directory: str) -> list[str]:
    out = []
    for root, _, names in os.walk(directory):
        out += [os.path.relpath(os.path.join(root, n), directory) for n in names]
    return sorted(f for f in out if f != CHECKSUMS)


def seal(directory: str) -> None:
    """Record the size and digest of every file under ``directory`` in its ``checksums.json``
    (nothing if the directory is gone: a step garbage-collected before it was sealed)."""
    try:
        files = _files(directory)
        digests = _digests(directory, files)
        record = {
            "algorithm": "crc32",
            "files": {
                f: {"bytes": os.path.getsize(os.path.join(directory, f)), "digest": d}
                for f, d in zip(files, digests, strict=True)
            },
        }
        if not files:
            return
        tmp = os.path.join(directory, CHECKSUMS + ".tmp")
        with open(tmp, "w") as f:
            json.dump(record, f)
        os.replace(tmp, os.path.join(directory, CHECKSUMS))
    except FileNotFoundError:
        return


def damage(directory: str) -> str | None:
    """What is wrong with a sealed checkpoint directory (the first damaged part), or None when
    every recorded file is there with its size and digest. Unsealed directories (written before
    checksums, or killed between Orbax's commit and the seal) are not judged here."""
    path = os.path.join(directory, CHECKSUMS)
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            record = json.load(f)["files"]
    except (OSError, ValueError, KeyError):
        return f"{CHECKSUMS} is unreadable"
    for rel, want in record.items():
        full = os.path.join(directory, rel)
        if not os.path.isfile(full):
            return f"{rel} is missing"
        if os.path.getsize(full) != want["bytes"]:
            return f"{rel} holds {os.path.getsize(full)} of its {want['bytes']} bytes"
    got = dict(zip(record, _digests(directory, list(record)), strict=True))
    bad = [rel for rel, want in record.items() if got[rel] != want["digest"]]
    if bad:
        more = f" (and {len(bad) - 1} more files)" if len(bad) > 1 else ""
        return f"{bad[0]} does not match its checksum{more}"
    return None


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text[:300]}"


def save_model(path: str, cfg: ModelConfig, params: Any) -> None:
    """Write a model directory. Refuses to overwrite an existing one."""
    path = os.path.abspath(path)
    if os.path.exists(os.path.join(path, "params")):
        raise CheckpointError(f"{path} already holds a model; choose a new output directory")
    os.makedirs(path, exist_ok=True)
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(os.path.join(path, "params"), jax.tree.map(np.asarray, params))
    seal(os.path.join(path, "params"))
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({"model": cfg.to_dict()}, f, indent=2)


def load_model_config(path: str) -> ModelConfig:
    cfg_file = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_file):
        raise CheckpointError(f"{path} is not a laplace model directory: no config.json")
    with open(cfg_file) as f:
        try:
            return ModelConfig.from_mapping(json.load(f)["model"])
        except (KeyError, json.JSONDecodeError, ConfigError) as e:
            raise CheckpointError(f"{cfg_file} is not a laplace model config: {e}") from e


def _on_one_device(cfg: ModelConfig, device: jax.Device | None) -> Any:
    """Abstract parameters of ``cfg`` placed on ``device`` (default: the first): a restore target."""
    sharding = jax.sharding.SingleDeviceSharding(device or jax.devices()[0])
    return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding), abstract_params(cfg))


def load_model(path: str, device: jax.Device | None = None) -> tuple[ModelConfig, Any]:
    """Read a model directory onto one device (default: the first): (ModelConfig, params)."""
    path = os.path.abspath(path)
    cfg = load_model_config(path)
    problem = damage(os.path.join(path, "params"))
    if problem:
        raise CheckpointError(f"the model in {path} is damaged ({problem}); re-export or copy it again")
    try:
        with ocp.StandardCheckpointer() as ckptr:
            params = ckptr.restore(os.path.join(path, "params"), _on_one_device(cfg, device))
    except (FileNotFoundError, ValueError) as e:
        raise CheckpointError(f"cannot restore {path}/params for the config in {path}/config.json: {e}") from e
    return cfg, params


@contextlib.contextmanager
def _quiet_absl(quiet: bool) -> Iterator[None]:
    """absl's warnings off inside the block when ``quiet`` (Orbax's notes on a read-only manager)."""
    logger = logging.getLogger("absl")
    level = logger.level
    if quiet:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


class TrainCheckpointer:
    """Save / restore training state under ``workdir/checkpoints``; ``read_only`` creates nothing."""

    def __init__(self, workdir: str, keep: int = 3, every: int = 100, read_only: bool = False):
        self.directory = os.path.join(os.path.abspath(workdir), "checkpoints")
        with _quiet_absl(read_only):  # Orbax warns that a reader is a reader: "directory is read only" and two more
            options = ocp.CheckpointManagerOptions(
                max_to_keep=None if read_only else keep,
                save_interval_steps=0 if read_only else every,
                create=not read_only,
                read_only=read_only,
            )
            self.manager = ocp.CheckpointManager(
                self.directory, options=options, item_names=("state", "data", "config")
            )
        self._every = every
        self._lead = jax.process_index() == 0
        self._unsealed: set[int] = set()
        self._sealer = ThreadPoolExecutor(1)
        self._seals: list[Future] = []

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def steps(self) -> list[int]:
        return sorted(self.manager.all_steps())

    def step_dir(self, step: int) -> str:
        return os.path.join(self.directory, str(step))

    def saved_config(self, step: int) -> dict:
        return self.manager.restore(step, args=ocp.args.Composite(config=ocp.args.JsonRestore()))["config"]

    def should_save(self, step: int) -> bool:
        """Whether ``save(step, ...)`` will write: every ``ckpt_every`` steps. (Orbax's own policy also
        saves a run's first step, a full write of the state that resuming from it would not repay.)"""
        return step % self._every == 0 and step != self.manager.latest_step()

    def save(self, step: int, state: Any, data_iter: Any, config: dict, force: bool = False) -> bool:
        args = ocp.args.Composite(
            state=ocp.args.StandardSave(state),
            data=grain.checkpoint.CheckpointSave(data_iter),
            config=ocp.args.JsonSave(config),
        )
        if not (force or self.should_save(step)):
            return False
        if self._seals:
            self._join_seals()  # a save may delete old steps: never while one is being sealed
        saved = self.manager.save(step, args=args, force=True)
        if saved and self._lead:
            self._unsealed.add(step)
        self._seal_finished()
        return saved

    def _seal_finished(self) -> None:
        """Checksum the steps Orbax has finished writing, in the background."""
        if self._unsealed and not self.manager.is_saving_in_progress():
            self._seals += [self._sealer.submit(seal, self.step_dir(s)) for s in sorted(self._unsealed)]
            self._unsealed.clear()

    def restore(self, step: int, abstract_state: Any, data_iter: Any) -> Any:
        """State onto the shardings in ``abstract_state``; ``data_iter`` is moved to the saved position."""
        args = ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract_state), data=grain.checkpoint.CheckpointRestore(data_iter)
        )
        return self.manager.restore(step, args=args)["state"]

    def restore_latest(
        self, abstract_state: Any, data_iter: Any, accept: Callable[[dict], None], log: Callable[[str], None]
    ) -> tuple[int | None, Any]:
        """(step, state) of the newest intact checkpoint, or (None, None) when there is none yet.

        Each candidate is verified against its checksums and read; a damaged one is named in one
        line and moved aside to ``<step>.corrupt``. ``accept(saved config)`` may raise to refuse
        a checkpoint of another run (that is the user's call, so nothing is moved then). With
        checkpoints present but none intact, raises CheckpointError instead of starting afresh."""
        moved = []
        for step in reversed(self.steps()):
            problem = damage(self.step_dir(step))
            if problem is None:
                try:
                    accept(self.saved_config(step))
                    return step, self.restore(step, abstract_state, data_iter)
                except Exception as e:  # classified below; anything else re-raises
                    if not _CORRUPTION.search(str(e)):
                        raise
                    problem = _one_line(e)
            moved.append(self._set_aside(step))
            log(f"checkpoint step {step} is damaged ({problem}); moved to {moved[-1]}, trying an older one")
        if moved:
            raise CheckpointError(
                f"no intact checkpoint in {self.directory}: the damaged ones were moved aside "
                f"({', '.join(os.path.basename(m) for m in moved)}). Restore one by hand, or start afresh "
                "with another --workdir"
            )
        return None, None

    def _set_aside(self, step: int) -> str:
        """Rename a damaged step directory to ``<step>.corrupt`` (``.corrupt.N`` if taken); never delete."""
        src = self.step_dir(step)
        dst, n = src + ".corrupt", 1
        while os.path.exists(dst):
            dst, n = f"{src}.corrupt.{n}", n + 1
        if self._lead:
            os.rename(src, dst)
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            multihost_utils.sync_global_devices(f"set aside {step}")
        self.manager.reload()
        return dst

    def restore_counters(self, step: int) -> dict[str, int]:
        """The train state's scalar counters (``step``, ``skipped``, ``nonfinite``) alone, on the host."""
        one = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
        item = {k: jax.ShapeDtypeStruct((), np.int32, sharding=one) for k in ("step", "skipped", "nonfinite")}
        args = ocp.args.PyTreeRestore(
            item=item, restore_args=ocp.checkpoint_utils.construct_restore_args(item), partial_restore=True
        )
        state = self.manager.restore(step, args=ocp.args.Composite(state=args))["state"]
        return {k: int(v) for k, v in jax.device_get(state).items()}

    def restore_params(self, step: int, abstract_params: Any) -> Any:
        """Only the parameters, onto the shardings in ``abstract_params`` (e.g. one device)."""
        item = {"params": abstract_params}
        args = ocp.args.PyTreeRestore(
            item=item, restore_args=ocp.checkpoint_utils.construct_restore_args(item), partial_restore=True
        )
        return self.manager.restore(step, args=ocp.args.Composite(state=args))["state"]["params"]

    def wait(self) -> None:
        """Finish pending writes and their checksums."""
        self.manager.wait_until_finished()
        self._seal_finished()
        self._join_seals()

    def _join_seals(self) -> None:
        for f in self._seals:
            f.result()
        self._seals.clear()

    def close(self) -> None:
        self.wait()
        self.manager.close()
        self._sealer.shutdown()


def load_trained(
    workdir: str, step: int | None = None, device: jax.Device | None = None
) -> tuple[dict, ModelConfig, Any]:
    """(run config dict, ModelConfig, params on one device) from a train.py workdir (newest step by
    default). Creates nothing; a damaged or missing step is a CheckpointError naming ``--step``."""
    ckpt = TrainCheckpointer(workdir, read_only=True)
    try:
        steps = ckpt.steps()
        if not steps:
            raise CheckpointError(
                f"no checkpoint in {workdir}; train one first: "
                f"python train.py --config configs/tiny.py --workdir {workdir}"
            )
        step = steps[-1] if step is None else step
        others = ", ".join(str(s) for s in reversed(steps) if s != step) or "none"
        if step not in steps:
            raise CheckpointError(f"{workdir} has no checkpoint at step {step}; its steps: {others}")
        problem = damage(ckpt.step_dir(step))
        try:
            if problem is None:
                run_cfg = ckpt.saved_config(step)
                cfg = ModelConfig.from_mapping(run_cfg["model"])
                return run_cfg, cfg, ckpt.restore_params(step, _on_one_device(cfg, device))
        except Exception as e:  # only unreadable bytes become "damaged"
            if not _CORRUPTION.search(str(e)):
                raise
            problem = _one_line(e)
        raise CheckpointError(
            f"checkpoint step {step} in {workdir} is damaged ({problem}); pick another with --step N (step=N) "
            f"(other steps: {others})"
        )
    finally:
        ckpt.close()
