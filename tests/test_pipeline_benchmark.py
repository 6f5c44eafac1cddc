"""benchmarks/pipeline.py: the overlap and steady-step figures on hand-built timelines."""


def _e(kind, step, start, end):
  return dict(kind=kind, step=step, start_s=start, end_s=end)


# Update 0 [1, 3] has rollout 1 [0, 2] beside it for 1 s of 2; update 1 [3, 5] has rollout
# 2 [3.5, 4] for 0.5 s of 2; update 2 is the last (nothing left to play beside it).
TIMELINE = [_e("rollout", 1, 0.0, 2.0), _e("update", 0, 1.0, 3.0), _e("host", 1, 3.0, 3.0),
            _e("rollout", 2, 3.5, 4.0), _e("update", 1, 3.0, 5.0), _e("update", 2, 5.0, 6.0)]


def test_overlap_is_update_time_under_a_playing_rollout(load_benchmark):
  bench = load_benchmark("pipeline")
  assert bench.overlap_fraction(TIMELINE) == 1.5 / 4
  assert bench.overlap_fraction(TIMELINE, {1}) == 0.5 / 2
  assert bench.overlap_fraction(TIMELINE, set()) == 0.0


def test_a_compilation_beside_an_update_makes_its_step_unsteady(load_benchmark):
  bench = load_benchmark("pipeline")
  # (end, seconds): one compilation over [1.5, 2.5], during update 0 and rollout 1.
  assert bench.steady_steps(TIMELINE, [(2.5, 1.0)]) == {1, 2}
  # Over [0, 0.5]: only rollout 1, which played beside update 0.
  assert bench.steady_steps(TIMELINE, [(0.5, 0.5)]) == {1, 2}
  assert bench.steady_steps(TIMELINE, [(3.75, 0.1)]) == {0, 2}


def test_the_first_update_s_own_jax_work_and_the_rollout_beside_it(load_benchmark):
  bench = load_benchmark("pipeline")
  work = [("jaxpr_trace_duration", "MainThread", 1.5, 0.5),  # In update 0, the learner's.
          ("jaxpr_to_mlir_module_duration", "MainThread", 2.0, 0.25),
          ("backend_compile_duration", "MainThread", 2.5, 0.125),
          ("jaxpr_trace_duration", "rollouts", 1.5, 0.5),  # The rollout thread's.
          ("backend_compile_duration", "MainThread", 4.0, 1.0)]  # In update 1.
  assert bench.first_update(TIMELINE, work, {1, 2}) == dict(
      update_s=2.0, rollout_beside_s=1.0, steady_update_s=1.5, trace_s=0.5, lower_s=0.25,
      compile_s=0.125)


def test_the_sequential_step_is_laid_end_to_end(load_benchmark):
  bench = load_benchmark("pipeline")
  lines = [{"step": 0, "time/rollout_s": 1.0, "time/host_s": 0.5, "time/update_s": 2.0},
           {"step": 1, "eval/accuracy": 0.5}]
  assert [(e["kind"], e["start_s"], e["end_s"]) for e in bench.sequential_timeline(lines)] == [
      ("rollout", 0.0, 1.0), ("host", 1.0, 1.5), ("update", 1.5, 3.5)]
