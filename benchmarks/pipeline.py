"""The bounded-staleness pipeline on CPU: a timeline per step, its overlap, the handoff.

  python benchmarks/pipeline.py --max_staleness=1 --devices=8 --rollout_devices=4 --steps=12
  python benchmarks/pipeline.py --max_staleness=0 --devices=8 --rollout_devices=0 --steps=12 \
      --out=benchmarks/results/pipeline-cpu-k0.json

Runs the colocated program (`configs/mgrpo.py:smoke`, a random tiny pair, its turns up to
`TURN_TOKENS` long) for `--steps` steps on `--devices` fake CPU devices and writes, to
`--out` and a PNG beside it: the timeline of every step (rollout, handoff, host work,
update: `pipeline.TIMELINE_FILE`; for k = 0 the sequential step's own phase times),
`overlap_fraction` (the share of update time during which a rollout was in flight, over
all steps and over the `steady` ones: no XLA compilation during the update or the
rollouts beside it), what the first update spent tracing, lowering and compiling its
programs (`first_update`: only the rollout of step 1 may play beside it), the staleness
histogram per agent, the handoff's bytes per version, and the handoff compiled for 8 GPUs
of `--gpu_target` split 4 + 4 at Qwen3-8B (bytes per GPU; XLA:GPU without a GPU, as
benchmarks/gpu_compile.py).
"""

import os
import sys

# The device count is an XLA flag: read before JAX is first imported.
_COUNT = next((a.split("=", 1)[1] for a in sys.argv if a.startswith("--devices=")), "8")
if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                             + f" --xla_force_host_platform_device_count={_COUNT}").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")  # No driver: compile only.

import functools  # noqa: E402
import json  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
from absl import app, flags  # noqa: E402

from mgrpo_jax.compiled import gpu, step_cases  # noqa: E402
from configs import mgrpo as mgrpo_config  # noqa: E402
from mgrpo_jax import handoff, metrics, pipeline, sharding  # noqa: E402
from mgrpo_jax.mgrpo import colocated, setup  # noqa: E402
from mgrpo_jax.models import decode, qwen3  # noqa: E402

LANES = {"rollout": "tab:blue", "handoff": "tab:purple", "warm": "tab:gray",
         "host": "tab:orange", "update": "tab:green"}  # The timeline's lanes and colours.
# smoke's turns stop at 24 tokens: rollouts far shorter than any real policy's (whose
# generation is most of an RL step); a random policy's turns here run 30-100 tokens.
TURN_TOKENS = 192
_COMPILES = []  # (end, seconds) of every XLA compilation, on the perf_counter clock.
# (phase, thread, end, seconds) of JAX's work before a program runs: tracing, lowering and
# compiling (or loading from the compilation cache).
_JAX_WORK = []
_PHASES = {"jaxpr_trace_duration": "trace_s", "jaxpr_to_mlir_module_duration": "lower_s",
           "backend_compile_duration": "compile_s"}


def _cuts(a: float, b: float, spans) -> float:
  return sum(max(0.0, min(b, s1) - max(a, s0)) for s0, s1 in spans)


def steady_steps(timeline: list[dict], compiles) -> set[int]:
  """Steps whose update, and every rollout beside it, ran without an XLA compilation."""
  spans = [(end - dt, end) for end, dt in compiles]
  rolls = [e for e in timeline if e["kind"] == "rollout"]
  out = set()
  for e in timeline:
    if e["kind"] == "update":
      beside = [r for r in rolls if _cuts(e["start_s"], e["end_s"], [(r["start_s"],
                                                                     r["end_s"])])]
      if not any(_cuts(x["start_s"], x["end_s"], spans) for x in [e] + beside):
        out.add(e["step"])
  return out


def overlap_fraction(timeline: list[dict], steps=None) -> float:
  """Share of the update time (of `steps`, default all) during which a rollout was playing.

  The last update is left out: no step is left to play beside it."""
  rolls = [(e["start_s"], e["end_s"]) for e in timeline if e["kind"] == "rollout"]
  last = max(e["step"] for e in timeline if e["kind"] == "update")
  total = covered = 0.0
  for e in timeline:
    if e["kind"] == "update" and e["step"] < last and (steps is None or e["step"] in steps):
      total += e["end_s"] - e["start_s"]
      covered += _cuts(e["start_s"], e["end_s"], rolls)  # One rollout thread: disjoint.
  return covered / total if total else 0.0


def first_update(timeline: list[dict], work, steady: set[int]) -> dict:
  """Update 0: its seconds, a steady update's (median), the rollout time beside it, and
  JAX's tracing, lowering and compiling on the learner's thread during it (`work` on the
  timeline's clock; events of nested programs overlap their parents')."""
  u = next(e for e in timeline if e["kind"] == "update" and e["step"] == 0)
  rolls = [(e["start_s"], e["end_s"]) for e in timeline if e["kind"] == "rollout"]
  out = dict(update_s=u["end_s"] - u["start_s"], rollout_beside_s=_cuts(u["start_s"],
                                                                         u["end_s"], rolls))
  ups = [e["end_s"] - e["start_s"] for e in timeline if e["kind"] == "update"
         and e["step"] in steady]
  out["steady_update_s"] = float(np.median(ups)) if ups else None
  for phase, key in _PHASES.items():
    out[key] = sum(dt for p, thread, end, dt in work if p == phase and thread == "MainThread"
                   and u["start_s"] <= end <= u["end_s"])
  return {key: None if v is None else round(v, 3) for key, v in out.items()}


def _jax_work(event: str, seconds: float, **kw) -> None:
  phase = event.rsplit("/", 1)[-1]
  if phase == "backend_compile_duration":
    _COMPILES.append((time.perf_counter(), seconds))
  if phase in _PHASES:
    _JAX_WORK.append((phase, threading.current_thread().name, time.perf_counter(), seconds))


def sequential_timeline(lines: list[dict]) -> list[dict]:
  """The k = 0 step's phases end to end, from its metrics (rollout, host work, update)."""
  out, t = [], 0.0
  for m in lines:
    if "time/update_s" not in m:
      continue
    for kind in ("rollout", "host", "update"):
      dt = m[f"time/{kind}_s"]
      out.append(dict(kind=kind, step=m["step"], start_s=t, end_s=t + dt))
      t += dt
  return out


def staleness(lines: list[dict], k: int) -> dict:
  """{agent: [rows of lag 0, 1, .., k]} summed over the steps."""
  return {agent: [int(sum(m.get(f"{agent}/staleness/count_{s}", 0.0) for m in lines))
                  for s in range(k + 1)]
          for agent in ("main", "sub") if any(f"{agent}/staleness/max" in m for m in lines)}


def handoff_bytes(c) -> dict:
  """Bytes one policy version moves, per agent and per receiving device (the run's agents)."""
  with tempfile.TemporaryDirectory() as tmp:
    p = setup.start(c, tmp)
  out = {"bytes_per_version": handoff.Handoff(p.agents, p.rollout_mesh).bytes_per_version()}
  if p.rollout_mesh is not None:
    per_device = lambda a: handoff.shard_bytes(
        jax.eval_shape(functools.partial(decode.decode_params, a.model_config), a.params),
        handoff.sampler_shardings(a.model_config, a.params, p.rollout_mesh)).tolist()
    out["bytes_per_rollout_device"] = {name: per_device(a) for name, a in p.agents.items()}
  return out


def gpu_handoff(target: str, preset: str = "qwen3_8b", split: int = 4) -> dict:
  """The handoff of `preset` compiled for 2 x `split` GPUs: the cast on the training half
  (memory per GPU) and the bytes each GPU sends and receives per version."""
  devices = gpu.devices(target, 2 * split)
  rollout, train = handoff.split_devices(split, devices)
  cfg = step_cases.model_config(preset)
  mesh_t, mesh_r = (sharding.make_mesh({"fsdp": -1}, d) for d in (train, rollout))
  stacked = qwen3.abstract_params(cfg)
  src = handoff.sampler_shardings(cfg, stacked, mesh_t)
  cast = jax.jit(functools.partial(decode.decode_params, cfg), out_shardings=src)
  t0 = time.perf_counter()
  compiled = cast.lower(step_cases.abstract(
      stacked, sharding.param_shardings(stacked, mesh_t))).compile()
  seconds = time.perf_counter() - t0
  sampler = jax.eval_shape(cast, stacked)
  masters = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(stacked))
  moved = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(sampler))
  return dict(target=target, preset=preset, devices=f"{split} rollout + {split} training",
              mesh="fsdp over each half", master_bytes=masters, bytes_per_version=moved,
              dtypes=sorted({str(x.dtype) for x in jax.tree.leaves(sampler)}),
              send_bytes_per_training_gpu=handoff.shard_bytes(sampler, src).tolist(),
              receive_bytes_per_rollout_gpu=handoff.shard_bytes(
                  sampler, handoff.sampler_shardings(cfg, stacked, mesh_r)).tolist(),
              cast_per_gpu=step_cases.memory_stats(compiled, seconds))


def _lanes(ax, timeline: list[dict], span: tuple[float, float]) -> None:
  """One lane per phase, each interval a bar labelled with its step (or version)."""
  for lane, (kind, color) in enumerate(LANES.items()):
    bars = [e for e in timeline if e["kind"] == kind and e["end_s"] > span[0]
            and e["start_s"] < span[1]]
    ax.broken_barh([(e["start_s"], e["end_s"] - e["start_s"]) for e in bars],
                   (lane - 0.4, 0.8), color=color, alpha=0.8)
    for e in bars:
      mid = (e["start_s"] + e["end_s"]) / 2
      if e["end_s"] - e["start_s"] > 0.03 * (span[1] - span[0]) and span[0] < mid < span[1]:
        ax.text(mid, lane, str(e["step"]), ha="center", va="center", fontsize=7)
  ax.set_xlim(*span)
  ax.set_yticks(range(len(LANES)), list(LANES))
  ax.invert_yaxis()
  ax.grid(alpha=0.3)


def plot(result: dict, out_png: str) -> str:
  """The whole timeline, its steady steps enlarged, and the staleness histograms, as a PNG."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  timeline, steady = result["timeline"], set(result["steady_steps"])
  fig = plt.figure(figsize=(13, 5.5), layout="constrained")
  grid = fig.add_gridspec(2, 2, width_ratios=(3, 1))
  ax = fig.add_subplot(grid[0, 0])
  _lanes(ax, timeline, (0.0, max(e["end_s"] for e in timeline)))
  ax.set_title(f"max_staleness={result['max_staleness']}, {result['devices']} devices, "
               f"rollout_devices={result['rollout_devices']}: the whole run (step 0 and new "
               f"shapes compile)", fontsize=10)
  zoom = fig.add_subplot(grid[1, 0])
  shown = [e for e in timeline if e["step"] in steady and e["kind"] == "update"]
  if shown:
    _lanes(zoom, timeline, (min(e["start_s"] for e in shown) - 0.05,
                            max(e["end_s"] for e in shown) + 0.05))
  zoom.set_xlabel("seconds")
  zoom.set_title(f"steps without compilation: overlap fraction "
                 f"{result['overlap_fraction_steady']:.2f}", fontsize=10)
  hx = fig.add_subplot(grid[:, 1])
  width = 0.8 / max(1, len(result["staleness"]))
  for i, (agent, counts) in enumerate(result["staleness"].items()):
    hx.bar(np.arange(len(counts)) + i * width, counts, width, label=agent)
  hx.set_xticks(range(result["max_staleness"] + 1))
  hx.set_xlabel("staleness (versions)")
  hx.set_ylabel("rows trained")
  hx.legend()
  hx.grid(alpha=0.3)
  fig.savefig(out_png, dpi=110)
  plt.close(fig)
  return out_png


def main(argv):
  del argv
  k, n = _K.value, _ROLLOUT_DEVICES.value
  c = mgrpo_config.get_config("smoke")
  c.update(dict(max_staleness=k, rollout_devices=n, num_steps=_STEPS.value,
                eval_every=_STEPS.value + 1, checkpoint_every=_STEPS.value + 1))
  c.limits.max_new_tokens = TURN_TOKENS
  c.log_to = "jsonl"  # metrics.jsonl only: no TensorBoard events between the steps.
  jax.monitoring.register_event_duration_secs_listener(_jax_work)
  with tempfile.TemporaryDirectory() as workdir:
    t0 = time.perf_counter()
    colocated.train_and_evaluate(c, workdir)
    wall = time.perf_counter() - t0
    lines = [m for m in metrics.read_metrics(workdir) if "time/update_s" in m]
    path = os.path.join(workdir, pipeline.TIMELINE_FILE)
    timeline = ([json.loads(x) for x in open(path)] if os.path.exists(path)
                else sequential_timeline(lines))
  # k = 0 has no clock of its own (its phases are laid end to end): no steady steps.
  origin = timeline[0].pop("perf_counter_s", None) if k else None
  steady = steady_steps(timeline, [(e - origin, dt) for e, dt in _COMPILES]) if k else set()
  step_s = {m["step"]: m["time/step_s"] for m in lines}
  result = dict(max_staleness=k, devices=jax.device_count(), rollout_devices=n,
                steps=_STEPS.value, config="configs/mgrpo.py:smoke",
                max_new_tokens=TURN_TOKENS, wall_s=round(wall, 2),
                timeline_source="pipeline" if k else "metrics (the sequential step's phases)",
                overlap_fraction=overlap_fraction(timeline), steady_steps=sorted(steady),
                overlap_fraction_steady=overlap_fraction(timeline, steady),
                step_s_steady=float(np.mean([step_s[s] for s in steady])) if steady else None,
                step_s_median=float(np.median(list(step_s.values()))),
                compile_s=round(sum(dt for _, dt in _COMPILES), 2),
                phase_s={kind: round(sum(e["end_s"] - e["start_s"] for e in timeline
                                         if e["kind"] == kind), 3) for kind in LANES},
                first_update=first_update(timeline, [(p, t, e - origin, dt)
                                                     for p, t, e, dt in _JAX_WORK], steady)
                if k else None,
                staleness=staleness(lines, k), handoff=handoff_bytes(c) if k else None,
                timeline=timeline)
  if _GPU_TARGET.value:
    result["gpu_handoff"] = gpu_handoff(_GPU_TARGET.value)
  os.makedirs(os.path.dirname(os.path.abspath(_OUT.value)), exist_ok=True)
  with open(_OUT.value, "w") as f:
    json.dump(result, f, indent=1)
  png = plot(result, os.path.splitext(_OUT.value)[0] + ".png")
  print(json.dumps({key: v for key, v in result.items() if key != "timeline"}, indent=1))
  print(f"Wrote {_OUT.value} and {png}.")


if __name__ == "__main__":
  # Flags only when run: tests load this file beside other benchmarks.
  _K = flags.DEFINE_integer("max_staleness", 1, "config.max_staleness (0: sequential).")
  flags.DEFINE_integer("devices", 8, "Fake CPU devices (read before JAX starts).")
  _ROLLOUT_DEVICES = flags.DEFINE_integer("rollout_devices", 4,
                                          "config.rollout_devices (0: all devices shared).")
  _STEPS = flags.DEFINE_integer("steps", 12, "Training steps.")
  _OUT = flags.DEFINE_string("out", "benchmarks/results/pipeline-cpu.json",
                             "Where to write the JSON (the PNG goes beside it).")
  _GPU_TARGET = flags.DEFINE_string("gpu_target", "h100_sxm",
                                    "Compile the 8-GPU handoff for this target ('' skips).")
  app.run(main)
