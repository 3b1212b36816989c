"""Executes a ``StepPlan`` on the device programs and returns what it read back (``StepOutput``).

The runner decides nothing: it runs the plan's slot operations in order, then its admission
(one prefill, one insert per member rank) or its decode calls (of two, the second is launched
before the first is read, and the scheduler's ``early_masks`` from the first are written while it
runs). A failed prefill is reported in the output (nothing was inserted: the slot buffers are
untouched); any other failure raises, and the engine recovers (the slot buffers are donated, so
they are rebuilt).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from laplace_jax.serve.plan import Move, Snapshot, StepOutput, StepPlan
from laplace_jax.serve.programs import DevicePrograms

EarlyMasks = Callable[[np.ndarray, np.ndarray], list[tuple[int, np.ndarray]]]


class Runner:
    """Runs plans on ``programs``; ``compile_on_demand``: a decode width with no executable is
    compiled when first planned (``buckets="exact"``) instead of being an error."""

    def __init__(self, programs: DevicePrograms, compile_on_demand: bool):
        self.programs, self.compile_on_demand = programs, compile_on_demand

    def execute(self, plan: StepPlan, early_masks: EarlyMasks | None = None) -> StepOutput:
        """Run ``plan``; ``early_masks``: the grammar writes due after the first of two decode calls
        (given its tokens and valid flags)."""
        out = StepOutput()
        self.programs.write_grammar(plan.grammar_writes)  # first: the inserts and decode read them
        for op in plan.slot_ops:
            if isinstance(op, Snapshot):
                out.snapshots.append(self.programs.snapshot(op.slots))
            else:
                assert isinstance(op, Move)
                self.programs.move(op.moves)
        adm = plan.admission
        if adm is not None:
            try:
                state, logits, out.scores, out.blocks = self.programs.prefill_rows(
                    adm.prompts, adm.score, adm.starts, adm.keep
                )
            except Exception as e:  # this admission only: the scheduler isolates the failing group
                out.prefill_error = f"{type(e).__name__}: {e}"
                return out
            out.first = [self.programs.insert(state, logits, where) for where in adm.inserts]
        if plan.decode_width is not None:
            out.decoded = self._decode(plan.decode_width, plan.decode_steps, early_masks)
        return out

    def _decode(self, width: int, steps: tuple[int, ...], early_masks: EarlyMasks | None) -> tuple:
        self._ensure_decode(width)
        if len(steps) <= 1:
            toks, valid, lps = self.programs.read(self.programs.launch(width, *steps))
            return toks, valid, (lps,)
        first, rest = self.programs.launch(width, steps[0]), self.programs.launch(width, steps[1])
        a = self.programs.read(first)
        if early_masks is not None:
            self.programs.write_grammar(early_masks(a[0], a[1]))  # while ``rest`` runs
        b = self.programs.read(rest)
        return np.concatenate([a[0], b[0]]), np.concatenate([a[1], b[1]]), (a[2], b[2])

    def _ensure_decode(self, width: int) -> None:
        """decode[width] must exist after warmup; only ``compile_on_demand`` compiles new widths here."""
        if self.programs.get("decode", width) is not None:
            return
        if not self.compile_on_demand:
            raise RuntimeError(f"no compiled decode[{width}] after warmup")  # never recompile silently
        self.programs.compile(*self.programs.decode_program(width))

    def reset(self) -> None:
        """Forget every executable and rebuild the slot buffers (after a device-loop failure)."""
        self.programs.executables.clear()
        self.programs.slots = self.programs.new_slots()
        self.programs.grammar = self.programs.new_grammar()
