"""Serve a GLA model with an OpenAI-compatible API: ``python serve.py --help`` lists the flags
(generated from ``laplace_jax.serve.config.ServeConfig``); the body is ``laplace_jax.serve.cli``.

    python serve.py                                   # newest train.py run under runs/
    python serve.py --checkpoint runs/tiny --port 8000 --max-num-seqs 16
"""

from __future__ import annotations

import sys

from laplace_jax.serve.cli import main, parse

__all__ = ["main", "parse"]

if __name__ == "__main__":
    sys.exit(main())
