"""benchmarks/hlo_stats.py on hand-written HLO: kernels, bytes written, loops, collectives."""

from mgrpo_jax.compiled import hlo_stats

# A loop of unknown trip count whose body runs a 4-trip inner loop: each inner iteration
# slices a [4, 8, 16] stack (a copy: 8 x 16 bf16 = 256 bytes), updates a [4, 2, 16] cache in
# place (one [1, 1, 16] row: 32 bytes) and all-gathers over groups of 4 of 8 devices.
HLO = """HloModule m, num_partitions=8

%fused_slice (p0: bf16[4,8,16], p1: s32[]) -> bf16[1,8,16] {
  %p0 = bf16[4,8,16]{2,1,0} parameter(0)
  %p1 = s32[] parameter(1)
  %z = s32[] constant(0)
  ROOT %ds = bf16[1,8,16]{2,1,0} dynamic-slice(%p0, %p1, %z, %z), dynamic_slice_sizes={1,8,16}
}

%fused_update (p0: bf16[4,2,16], p1: bf16[1,1,16], p2: s32[]) -> bf16[4,2,16] {
  %p0 = bf16[4,2,16]{2,1,0} parameter(0)
  %p1 = bf16[1,1,16]{2,1,0} parameter(1)
  %p2 = s32[] parameter(2)
  %z = s32[] constant(0)
  ROOT %dus = bf16[4,2,16]{2,1,0} dynamic-update-slice(%p0, %p1, %p2, %z, %z)
}

%inner_body (t: (s32[], bf16[4,8,16], bf16[4,2,16], bf16[1,1,16])) -> (s32[], bf16[4,8,16], bf16[4,2,16], bf16[1,1,16]) {
  %t = (s32[], bf16[4,8,16]{2,1,0}, bf16[4,2,16]{2,1,0}, bf16[1,1,16]{2,1,0}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %w = bf16[4,8,16]{2,1,0} get-tuple-element(%t), index=1
  %c = bf16[4,2,16]{2,1,0} get-tuple-element(%t), index=2
  %u = bf16[1,1,16]{2,1,0} get-tuple-element(%t), index=3
  %slice = bf16[1,8,16]{2,1,0} fusion(%w, %i), kind=kLoop, calls=%fused_slice
  %upd = bf16[4,2,16]{2,1,0} fusion(%c, %u, %i), kind=kLoop, calls=%fused_update
  %ag = bf16[4,8,16]{2,1,0} all-gather(%slice), channel_id=1, replica_groups=[2,4]<=[8], dimensions={0}
  ROOT %r = (s32[], bf16[4,8,16]{2,1,0}, bf16[4,2,16]{2,1,0}, bf16[1,1,16]{2,1,0}) tuple(%i, %w, %upd, %u)
}

%inner_cond (t: (s32[], bf16[4,8,16], bf16[4,2,16], bf16[1,1,16])) -> pred[] {
  %t = (s32[], bf16[4,8,16]{2,1,0}, bf16[4,2,16]{2,1,0}, bf16[1,1,16]{2,1,0}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %n = s32[] constant(4)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

%outer_body (t: (s32[], bf16[4,8,16], bf16[4,2,16], bf16[1,1,16])) -> (s32[], bf16[4,8,16], bf16[4,2,16], bf16[1,1,16]) {
  %t = (s32[], bf16[4,8,16]{2,1,0}, bf16[4,2,16]{2,1,0}, bf16[1,1,16]{2,1,0}) parameter(0)
  ROOT %w = (s32[], bf16[4,8,16]{2,1,0}, bf16[4,2,16]{2,1,0}, bf16[1,1,16]{2,1,0}) while(%t), condition=%inner_cond, body=%inner_body, backend_config={"known_trip_count":{"n":"4"}}
}

%outer_cond (t: (s32[], bf16[4,8,16], bf16[4,2,16], bf16[1,1,16])) -> pred[] {
  %t = (s32[], bf16[4,8,16]{2,1,0}, bf16[4,2,16]{2,1,0}, bf16[1,1,16]{2,1,0}) parameter(0)
  ROOT %p = pred[] constant(true)
}

ENTRY %main (a: (s32[], bf16[4,8,16], bf16[4,2,16], bf16[1,1,16])) -> (s32[], bf16[4,8,16], bf16[4,2,16], bf16[1,1,16]) {
  %a = (s32[], bf16[4,8,16]{2,1,0}, bf16[4,2,16]{2,1,0}, bf16[1,1,16]{2,1,0}) parameter(0)
  ROOT %loop = (s32[], bf16[4,8,16]{2,1,0}, bf16[4,2,16]{2,1,0}, bf16[1,1,16]{2,1,0}) while(%a), condition=%outer_cond, body=%outer_body
}
"""


def test_a_loop_iteration_counts_inner_trips_and_in_place_updates_by_their_update():
  module = hlo_stats.parse(HLO)
  loop = module.outer_loop()
  assert loop.name == "loop" and loop.trip_count is None
  summary = hlo_stats.loop_summary(module, loop, num_layers=4)
  # Per inner iteration: slice, update, all-gather, compare (the condition): 4 kernels.
  assert summary["kernels"] == 4 * 4 and summary["kernels_per_layer"] == 4
  # 256 (slice) + 32 (the updated row, not the 256-byte cache) + 1024 (all-gather) + 1 (pred).
  assert summary["bytes_written"] == 4 * (256 + 32 + 1024 + 1)


def test_copies_finds_the_slice_of_the_stack_but_not_the_in_place_update():
  module = hlo_stats.parse(HLO)
  targets = hlo_stats.copy_targets({"w": ((4, 8, 16), "bfloat16"),
                                    "cache": ((4, 2, 16), "bfloat16")}, num_layers=4)
  found = hlo_stats.copies(module, module.outer_loop(), targets)
  assert [(c["kernel"], c["target"], c["times"]) for c in found] == [("slice", "w", 4.0)]


def test_collectives_with_group_sizes_and_received_bytes():
  module = hlo_stats.parse(HLO)
  (c,) = hlo_stats.collectives(module, 8, node_of=[0] * 4 + [1] * 4)
  # Groups [0..3] and [4..7]: each within one node; a device receives 3/4 of the output.
  assert c["kind"] == "all-gather" and c["group_size"] == 4 and c["times"] == 4
  assert c["received_bytes"] == 1024 * 3 / 4 and not c["crosses_nodes"]
  (c,) = hlo_stats.collectives(module, 8, node_of=[0, 1] * 4)
  assert c["crosses_nodes"]


def test_replica_group_forms():
  groups = hlo_stats.replica_groups
  assert groups("replica_groups={{0,2},{1,3}}", 4) == [[0, 2], [1, 3]]
  assert groups("replica_groups=[2,2]<=[4]", 4) == [[0, 1], [2, 3]]
  assert groups("replica_groups=[2,2]<=[2,2]T(1,0)", 4) == [[0, 2], [1, 3]]
  assert groups("replica_groups=mesh['axis_0'=2,'axis_1'=2] {'axis_0'}", 4) == [[0, 2], [1, 3]]
  assert groups("replica_groups=mesh['axis_0'=2,'axis_1'=2] {'axis_1'}", 4) == [[0, 1], [2, 3]]
  assert groups("replica_groups={}", 4) == [[0, 1, 2, 3]]


def test_received_bytes_are_ring_volumes():
  instr = hlo_stats.Instr("x", "reduce-scatter", hlo_stats.arrays("f32[8]"), ["f32[8]"], [],
                          "", False)
  assert hlo_stats.received_bytes(instr, 4) == 32 * 3
  instr.opcode = "all-reduce"
  assert hlo_stats.received_bytes(instr, 4) == 2 * 32 * 3 / 4
  start = hlo_stats.Instr("y", "all-gather-start", hlo_stats.arrays("(bf16[2], bf16[8])"),
                          ["bf16[2]", "bf16[8]"], [], "", False)
  assert hlo_stats.received_bytes(start, 4) == 16 * 3 / 4
