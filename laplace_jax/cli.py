"""Shared absl entry-point plumbing: config-flag parsing and user errors without tracebacks."""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable

from absl import app, flags
from absl import logging as absl_logging

from laplace_jax.errors import UserError


def _parse(argv: list[str]) -> list[str]:
    try:
        return flags.FLAGS(argv)
    except flags.Error as e:
        sys.exit(f"error: {e}\nRun with --help for the flags.")
    except (KeyError, AttributeError, TypeError, ValueError) as e:
        # ml_collections raises these for a --config.x.y override naming an unknown or mistyped field.
        msg = str(e.args[0] if e.args else e).replace("\\n", " ").replace("\\'", "").replace("'", "")
        sys.exit(f"error: bad config override: {msg}")


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
