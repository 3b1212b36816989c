"""Collective bytes read from compiled HLO: loop bodies count trip-count times."""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

from laplace_jax.hlo_stats import collective_bytes


def test_collective_inside_scan_counts_per_iteration():
    mesh = jax.make_mesh((8,), ("x",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:8])

    def body(x):
        def step(c, _):
            return jax.lax.all_to_all(c, "x", 0, 0, tiled=True) * 1.5, None

        return jax.lax.scan(step, x, None, length=24)[0]

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x")))
    stats = collective_bytes(f.lower(jax.ShapeDtypeStruct((64, 16), jnp.float32)).compile().as_text())
    assert stats["all-to-all"]["ops"] == 24
    assert stats["all-to-all"]["bytes"] == 24 * 8 * 16 * 4  # per-device block [8, 16] f32, 24 times
    assert stats["all-gather"]["ops"] == 0


# A while loop as the TPU compiler prints it (abridged from a compiled scan of 10 steps): no
# known_trip_count, the count is in the loop itself; stack frames name the source.
TPU_LOOP = """HloModule jit_g, is_scheduled=true

FileNames
1 "/src/laplace_jax/ops/gla/chunk.py"

FunctionNames
1 "outer"
2 "inner"

FileLocations
1 {file_name_id=1 function_name_id=1 line=10 end_line=10 column=1 end_column=2}
2 {file_name_id=1 function_name_id=2 line=20 end_line=20 column=1 end_column=2}

StackFrames
1 {file_location_id=1 parent_frame_id=1}
2 {file_location_id=2 parent_frame_id=2}

%fused (p: f32[1024,1024]) -> f32[1024,1024] {
  %p = f32[1024,1024]{1,0} parameter(0)
  ROOT %m = f32[1024,1024]{1,0} multiply(%p, %p), metadata={op_name="jit(g)/while/body/mul" stack_frame_id=2}
}

%body (t: (s32[], f32[1024,1024], s32[])) -> (s32[], f32[1024,1024], s32[]) {
  %c1 = s32[]{:T(128)} constant(2)
  %t = (s32[]{:T(128)}, f32[1024,1024]{1,0}, s32[]{:T(128)}) parameter(0)
  %i = s32[]{:T(128)} get-tuple-element(%t), index=0
  %next = s32[]{:T(128)} add(%i, %c1), metadata={op_name="jit(g)/while/body/add"}
  %x = f32[1024,1024]{1,0} get-tuple-element(%t), index=1
  %f = f32[1024,1024]{1,0} fusion(%x), kind=kLoop, calls=%fused, backend_config={"estimated_cycles":"1000"}
  %k = s32[]{:T(128)} get-tuple-element(%t), index=2
  ROOT %r = (s32[]{:T(128)}, f32[1024,1024]{1,0}, s32[]{:T(128)}) tuple(%next, %f, %k)
}

%cond (t: (s32[], f32[1024,1024], s32[])) -> pred[] {
  %lim = s32[]{:T(128)} constant(20)
  %t = (s32[]{:T(128)}, f32[1024,1024]{1,0}, s32[]{:T(128)}) parameter(0)
  %i = s32[]{:T(128)} get-tuple-element(%t), index=0
  ROOT %lt = pred[]{:T(512)} compare(%i, %lim), direction=LT
}

ENTRY %main (x: f32[1024,1024]) -> f32[1024,1024] {
  %zero = s32[]{:T(128)} constant(0)
  %one = s32[]{:T(128)} constant(1)
  %x = f32[1024,1024]{1,0} parameter(0)
  %start = s32[]{:T(128)} copy(%zero)
  %init = (s32[]{:T(128)}, f32[1024,1024]{1,0}, s32[]{:T(128)}) tuple(%start, %x, %one)
  %w = (s32[]{:T(128)}, f32[1024,1024]{1,0}, s32[]{:T(128)}) while(%init), condition=%cond, body=%body
  ROOT %out = f32[1024,1024]{1,0} get-tuple-element(%w), index=1
}
"""


def test_trip_count_is_read_from_the_loop_where_the_compiler_prints_none():
    from laplace_jax.hlo_stats import Module, loops

    module = Module(TPU_LOOP)
    assert [lp["trips"] for lp in loops(module)] == [10]  # 0, 2, .., 18 < 20
    mult = module.multiplicities(control_only=True)
    assert mult["body"] == 10 and mult["cond"] == 11 and "fused" not in mult
    changed = Module(TPU_LOOP.replace("direction=LT", "direction=LE"))
    assert [lp["trips"] for lp in loops(changed)] == [11]  # 0, 2, .., 20 <= 20
    unreadable = Module(TPU_LOOP.replace("add(%i, %c1)", "multiply(%i, %c1)"))
    assert [lp["trips"] for lp in loops(unreadable)] == [None]


def test_estimate_sums_cycles_times_trips_and_names_the_source():
    from laplace_jax.tpu import CHIPS, estimate

    est = estimate(TPU_LOOP, CHIPS["v5e"])
    assert est["cycles"] == 10 * 1000
    assert est["seconds"] == 10 * 1000 / 1.5e9
    (row,) = est["by_source"]
    assert row["source"] == "ops/gla/chunk.py:20 inner" and set(row["primitives"]) == {"mul"}
    assert est["unestimated"] == {}  # scalars and tuples are bookkeeping, not left-out work


def test_a_relayout_reshape_counts_at_its_dma_floor():
    """A reshape the compiler kept (a relayout; a free one prints as a bitcast) carries no
    estimated_cycles: the estimate counts it at the DMA floor of reading and writing its result
    (4 MiB each way here), ten times in the loop, and a bitcast stays free."""
    from laplace_jax.tpu import CHIPS, dma_floor, estimate

    chip = CHIPS["v5e"]
    relayout = '%f = f32[1024,1024]{1,0} reshape(%x), metadata={op_name="jit(g)/while/body/reshape" stack_frame_id=2}'
    text = TPU_LOOP.replace(
        '%f = f32[1024,1024]{1,0} fusion(%x), kind=kLoop, calls=%fused, backend_config={"estimated_cycles":"1000"}',
        relayout,
    )
    est = estimate(text, chip)
    assert est["seconds"] == pytest.approx(10 * dma_floor(chip, 2 * 1024 * 1024 * 4))
    assert est["unestimated"] == {} and set(est["by_source"][0]["primitives"]) == {"reshape"}
    assert estimate(text.replace(" reshape(%x)", " bitcast(%x)"), chip)["seconds"] == 0


# lax.cond inside a 10-step loop, as the TPU compiler prints it (abridged): the true branch does
# 700 cycles of work and holds a nested conditional (50 or 20), the false branch 100.
TPU_COND = """HloModule jit_h, is_scheduled=true

%fused_a (p: f32[1024]) -> f32[1024] {
  %p = f32[1024]{0} parameter(0)
  ROOT %m = f32[1024]{0} multiply(%p, %p), metadata={op_name="jit(h)/while/body/cond/branch_1_fun/mul"}
}

%fused_b (p: f32[1024]) -> f32[1024] {
  %p = f32[1024]{0} parameter(0)
  ROOT %m = f32[1024]{0} add(%p, %p), metadata={op_name="jit(h)/while/body/cond/branch_0_fun/add"}
}

%in_hi (x: f32[1024]) -> f32[1024] {
  %x = f32[1024]{0} parameter(0)
  ROOT %f = f32[1024]{0} fusion(%x), kind=kLoop, calls=%fused_a, backend_config={"estimated_cycles":"50"}
}

%in_lo (x: f32[1024]) -> f32[1024] {
  %x = f32[1024]{0} parameter(0)
  ROOT %f = f32[1024]{0} fusion(%x), kind=kLoop, calls=%fused_b, backend_config={"estimated_cycles":"20"}
}

%dear (x: f32[1024]) -> f32[1024] {
  %x = f32[1024]{0} parameter(0)
  %f = f32[1024]{0} fusion(%x), kind=kLoop, calls=%fused_a, backend_config={"estimated_cycles":"700"}
  %q = s32[]{:T(128)} constant(1)
  ROOT %c = f32[1024]{0} conditional(%q,%f,%f), branch_computations={%in_hi,%in_lo}, metadata={op_name="skip_unless/"}
}

%cheap (x: f32[1024]) -> f32[1024] {
  %x = f32[1024]{0} parameter(0)
  ROOT %f = f32[1024]{0} fusion(%x), kind=kLoop, calls=%fused_b, backend_config={"estimated_cycles":"100"}
}

%body (t: (s32[], f32[1024])) -> (s32[], f32[1024]) {
  %one = s32[]{:T(128)} constant(1)
  %t = (s32[]{:T(128)}, f32[1024]{0}) parameter(0)
  %i = s32[]{:T(128)} get-tuple-element(%t), index=0
  %next = s32[]{:T(128)} add(%i, %one)
  %x = f32[1024]{0} get-tuple-element(%t), index=1
  %b = s32[]{:T(128)} and(%i, %one)
  %y = f32[1024]{0} conditional(%b, %x, %x), branch_computations={%cheap, %dear}
  ROOT %r = (s32[]{:T(128)}, f32[1024]{0}) tuple(%next, %y)
}

%cond (t: (s32[], f32[1024])) -> pred[] {
  %lim = s32[]{:T(128)} constant(10)
  %t = (s32[]{:T(128)}, f32[1024]{0}) parameter(0)
  %i = s32[]{:T(128)} get-tuple-element(%t), index=0
  ROOT %lt = pred[]{:T(512)} compare(%i, %lim), direction=LT
}

ENTRY %main (x: f32[1024]) -> f32[1024] {
  %zero = s32[]{:T(128)} constant(0)
  %x = f32[1024]{0} parameter(0)
  %start = s32[]{:T(128)} copy(%zero)
  %init = (s32[]{:T(128)}, f32[1024]{0}) tuple(%start, %x)
  %w = (s32[]{:T(128)}, f32[1024]{0}) while(%init), condition=%cond, body=%body
  ROOT %out = f32[1024]{0} get-tuple-element(%w), index=1
}
"""


def test_a_conditional_counts_its_costliest_branch():
    """One run takes one branch: the estimate counts the dearer one (700 plus its nested
    conditional's dearer 50) per loop step, not the sum of both branches (which the
    estimate did before: 870 per step), and names only that branch's ops. With optional work
    skipped, the nested conditional (``platform.skip_unless``'s, by its name scope) takes its
    cheaper branch (20) and the outer one still its dearer."""
    from laplace_jax.hlo_stats import Module
    from laplace_jax.tpu import CHIPS, estimate

    module = Module(TPU_COND)
    assert module.multiplicities(control_only=True)["cheap"] == 10  # structurally, every branch is reachable
    est = estimate(TPU_COND, CHIPS["v5e"])
    assert est["cycles"] == 10 * (700 + 50)
    skipped = est["optional_skipped_seconds"] * CHIPS["v5e"].clock_ghz * 1e9  # optional work at its cheapest
    assert skipped == pytest.approx(10 * (700 + 20))  # the outer conditional is not skip_unless's: still the dearer
    assert {r["source"] for r in est["by_source"]} == {"(no source)"}
    assert set(est["by_source"][0]["primitives"]) == {"mul"}  # the cheap branch's add is not counted
    mult = module.multiplicities(control_only=True, branch=lambda ins: {"y": "dear", "c": "in_hi"}.get(ins.name, ""))
    assert mult["dear"] == 10 and mult["in_hi"] == 10 and "cheap" not in mult and "in_lo" not in mult


def test_stack_frames_chain_to_their_callers():
    """An op's frame is its innermost; each frame's parent_frame_id is the caller's table id + 1."""
    from laplace_jax.hlo_stats import Module

    assert [f[1] for f in Module(TPU_LOOP).frames()[2]] == ["inner", "outer"]  # 2 -> table id 1
    alone = TPU_LOOP.replace("2 {file_location_id=2 parent_frame_id=2}", "2 {file_location_id=2 parent_frame_id=0}")
    assert [f[1] for f in Module(alone).frames()[2]] == ["inner"]
    assert Module(TPU_LOOP).frames()[1] == [("/src/laplace_jax/ops/gla/chunk.py", "outer", 10)]


def test_wire_bytes_use_each_collectives_own_group():
    """On a 2 x 4 mesh, an all-gather over the 4-device axis and a reduce-scatter over the 2-device
    one: their ring bytes follow their own groups ((n-1)/n of the result, n-1 shards), not the 8
    devices, in each form a replica group is printed."""
    from laplace_jax.hlo_stats import group_size

    mesh = jax.make_mesh((2, 4), ("a", "b"), axis_types=(jax.sharding.AxisType.Auto,) * 2, devices=jax.devices()[:8])

    def body(x):
        return jax.lax.psum_scatter(jax.lax.all_gather(x, "b", tiled=True), "a", tiled=True)

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("a", "b"), out_specs=P(("a", "b")), check_vma=False))
    stats = collective_bytes(f.lower(jax.ShapeDtypeStruct((16, 16), jnp.float32)).compile().as_text())
    gathered = 8 * 16 * 4  # [8, 4 x 4] f32 after gathering b
    assert stats["all-gather"]["bytes"] == gathered and stats["all-gather"]["wire"] == gathered * 3 / 4
    assert stats["reduce-scatter"]["wire"] == stats["reduce-scatter"]["bytes"] * 1  # n - 1 = 1 shard
    assert group_size("x = f32[4] all-gather(y), replica_groups={{0,1,2,3},{4,5,6,7}}", 8) == 4
    assert group_size("x = f32[4] all-gather(y), replica_groups=[4,2]<=[2,4]T(1,0)", 8) == 2
    assert group_size("x = f32[4] all-reduce(y), replica_groups=mesh['a'=2,'b'=4] {'b'}, to_apply=%r", 8) == 4
    assert group_size("x = f32[4] all-reduce(y), replica_groups={}, to_apply=%r", 8) == 8
