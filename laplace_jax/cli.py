"""Shared absl entry-point plumbing: config-flag parsing and user errors without tracebacks."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable
from typing import Any

from absl import app, flags
from absl import logging as absl_logging

from laplace_jax.errors import UserError


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows a flag's default once: not when it is None or its help already says it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.default in (None, False) or action.default is argparse.SUPPRESS or "default" in text.lower():
            return text
        return super()._get_help_string(action)


def _config_path(argv: list[str]) -> str | None:
    """The file of ``--config PATH`` / ``--config=PATH[:variant]`` in ``argv``, if any."""
    for i, arg in enumerate(argv):
        if arg == "--config" and i + 1 < len(argv):
            return argv[i + 1].split(":")[0]
        if arg.startswith("--config="):
            return arg.split("=", 1)[1].split(":")[0]
    return None


def _parse(argv: list[str]) -> list[str]:
    path = _config_path(argv)
    if path is not None and not os.path.isfile(path):
        near = os.path.dirname(path) or "."
        known = sorted(f for f in os.listdir(near) if f.endswith(".py")) if os.path.isdir(near) else []
        hint = f" ({near}/ holds {', '.join(known)})" if known else ""
        sys.exit(f"error: config file {path} does not exist{hint}")
    try:
        return flags.FLAGS(argv)
    except flags.Error as e:
        sys.exit(f"error: {e}\nRun with --help for the flags.")
    except (KeyError, AttributeError, TypeError, ValueError) as e:
        # ml_collections raises these for a --config.x.y override naming an unknown or mistyped field.
        msg = str(e.args[0] if e.args else e).replace("\\n", " ").replace("\\'", "").replace("'", "")
        sys.exit(f"error: bad config override: {msg}")


def plan_text(cfg: Any, topology: str | None, usd_per_chip_hour: float, as_json: bool) -> str:
    """``train.py --plan [--topology T]``: the report as text or JSON. Both compile on this
    machine's CPU backend: fake CPU devices for the config's mesh, or a TPU topology's
    compile-only devices."""
    import json

    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax

    if topology:
        from laplace_jax.train.tpu_plan import format_tpu_plan, reserve_cpu_devices, tpu_plan

        reserve_cpu_devices(topology)
        rep = tpu_plan(cfg, topology, usd_per_chip_hour)
        return json.dumps(rep, indent=2) if as_json else format_tpu_plan(rep)
    jax.config.update("jax_num_cpu_devices", max(1, cfg.mesh.data) * max(1, cfg.mesh.fsdp) * cfg.mesh.context)
    from laplace_jax.train.plan import format_plan, plan

    rep = plan(cfg)
    return json.dumps(rep, indent=2) if as_json else format_plan(rep)


def run(main: Callable[[list[str]], None]) -> None:
    """``absl.app.run`` with readable errors for config typos and every ``UserError``."""
    logging.getLogger("jax._src.xla_bridge").setLevel(logging.WARNING)  # no "Unable to initialize backend 'tpu'"
    absl_logging.set_verbosity(absl_logging.WARNING)  # Orbax logs every save at INFO; --verbosity=0 restores it

    def guarded(argv: list[str]) -> None:
        if "config" in flags.FLAGS:
            try:
                "model" in flags.FLAGS.config  # noqa: B015 -- config files load lazily; surface a bad path here
            except OSError as e:
                sys.exit(f"error: {e.__cause__ or e}")
        try:
            main(argv)
        except UserError as e:
            sys.exit(f"error: {e}")

    app.run(guarded, flags_parser=_parse)
