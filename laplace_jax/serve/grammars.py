"""The server's structured-output compiles: a request's constraint to its token automaton, off
the event loop, within a time limit, cached by the constraint's hash (``structured.Compiler``)."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from laplace_jax.errors import InvalidParamError, UserError
from laplace_jax.serve.engine import Engine
from laplace_jax.serve.protocol import ApiError
from laplace_jax.serve.structured import Compiler, Constraint, HostGrammar, LLGuidance, OutlinesCore, TokenAutomaton

COMPILERS = 2  # threads compiling constraints at once (a slow one holds one of them, never the event loop)


class Grammars:
    def __init__(self, engine: Engine, tokenizer: Any):
        self.engine, self.tok = engine, tokenizer
        self._threads = ThreadPoolExecutor(COMPILERS, thread_name_prefix="grammar")
        self._compiler: Compiler | None = None

    def compiler(self) -> Compiler:
        """The compiler for this tokenizer (built on first use); ApiError 400 for a tokenizer
        whose tokens' bytes are unknown."""
        if self._compiler is None:
            try:
                token_bytes = self.tok.token_bytes()
            except UserError as e:
                raise ApiError(400, f"structured outputs are not available: {e}") from None
            backend, V = OutlinesCore(token_bytes, self.tok.eos_id), self.engine.vocab_size
            host = LLGuidance(token_bytes, self.tok.eos_id, V)
            states = self.engine.serve.structured_states
            self._compiler = Compiler(backend, V, self.tok.eos_id, states, host)
        return self._compiler

    async def automaton(self, c: Constraint | None) -> TokenAutomaton | HostGrammar | None:
        """``c`` compiled (or cached) on a compile thread within ``structured_timeout_s``; ApiError
        400 naming the field for an invalid, unenforceable, too large or too slow constraint."""
        if c is None:
            return None
        compiler = self.compiler()
        hit = compiler.cached(c)
        if hit is not None:
            return hit
        timeout = self.engine.serve.structured_timeout_s
        job = asyncio.get_running_loop().run_in_executor(self._threads, compiler.compile, c)
        try:
            a = await asyncio.wait_for(job, timeout)
        except InvalidParamError as e:
            raise ApiError(400, str(e), e.param) from None
        except TimeoutError:
            raise ApiError(400, f"{c.field}: did not compile within {timeout:g} s; simplify it", c.field) from None
        if self.engine.metrics is not None:
            self.engine.metrics.on_grammar(a)
        return a
