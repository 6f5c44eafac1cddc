"""The hierarchy ablation on multi-hop research over long pages (PAPERS.md 1.7, issue 18).

  python benchmarks/hierarchy_sweep.py --size=cpu --workdir=/tmp/hier     # the CPU sweep, ~71 min
  python benchmarks/hierarchy_sweep.py --size=smoke --seeds=2 --workdir=/tmp/hs # end to end
  python benchmarks/hierarchy_sweep.py --size=gpu --workdir=/w            # one H100/H200

Runs `configs/mgrpo.py:hierarchy_sweep(size)`: M-GRPO, frozen sub-agent, shared weights,
single agent with every tool and M-GRPO without trajectory alignment (`unaligned`), for
`--seeds` seeds each, on `task=multihop` (the same questions, limits and number of updates
for every variant). Each set of agents gets one SFT warm start on the experts' traces
(`configs/sft.py` with the same arguments, one recipe): main + sub (shared by mgrpo,
frozen_sub and unaligned, which start from the same two agents), one model for `shared`, and
the single agent; every seed starts from its variant's warm start. The noise-free experts are
evaluated too: the ceiling under the context budget, per question kind; and so are the
experts slipping as often as the warm start's demonstrations (`kind="teacher"`): what the
warm start imitates.

Writes `--out` (JSON): per run, the held-out evaluations at every evaluation step (accuracy
overall, by pages needed `hops<n>` and by kind; context overflow rate; delegations per
episode) and the time spent; per variant, the mean and the 95% t-interval over seeds of each
of those at each step and at the end; per variant, what RL added to its warm start and
M-GRPO's lead over it, seed by seed, with 95% t-intervals. And `--plot` (PNG): held-out
accuracy by step, overall and by hop count, mean with the 95% t-interval band per variant.
"""

import json
import os
import platform
import shutil
import time

import jax
import numpy as np
from absl import app, flags, logging

from configs import mgrpo as mgrpo_config
from configs import sft as sft_config
from mgrpo_jax import evaluate, metrics, plotting
from mgrpo_jax.mgrpo import colocated, sft

_SIZE = flags.DEFINE_enum("size", "cpu", ["cpu", "gpu", "smoke"], "Task size (configs/mgrpo.py).")
_SEEDS = flags.DEFINE_integer("seeds", 5, "Seeds per variant.")
_WORKDIR = flags.DEFINE_string("workdir", "/tmp/hierarchy_sweep", "Runs go to subfolders.")
_OUT = flags.DEFINE_string("out", "", "Results JSON (default benchmarks/results/"
                           "hierarchy-sweep-<size>.json; smoke: in --workdir).")
_PLOT = flags.DEFINE_string("plot", "", "Curves PNG (default: --out with .png).")
_ONLY = flags.DEFINE_list("only", None, "Run only these variants (e.g. mgrpo,single).")
_REUSE = flags.DEFINE_bool("reuse", False, "Keep finished warm starts and runs in --workdir.")

_FLAG = {"cpu": "runlocal", "gpu": "gpu", "smoke": "smoke"}
# The warm start each variant starts from: variants with the same agents share one.
WARM_START = {"mgrpo": "mgrpo", "frozen_sub": "mgrpo", "unaligned": "mgrpo",
              "shared": "shared", "single": "single"}


def _done(workdir: str) -> bool:
  return _REUSE.value and os.path.exists(os.path.join(workdir, "done.json"))


def _timed(workdir: str, run) -> float:
  """Runs `run()` from scratch in `workdir` (or reuses a finished one); its wall seconds."""
  marker = os.path.join(workdir, "done.json")
  if _done(workdir):
    with open(marker) as f:
      return json.load(f)["wall_s"]
  shutil.rmtree(workdir, ignore_errors=True)  # A sweep measures runs from scratch.
  t0 = time.perf_counter()
  run()
  wall = time.perf_counter() - t0
  with open(marker, "w") as f:
    json.dump({"wall_s": wall}, f)
  return wall


def _evals(workdir: str) -> list[dict]:
  """The run's evaluations: {"step", and every eval/ metric without its prefix}."""
  return [{"step": r["step"], **{k.removeprefix("eval/"): v for k, v in r.items()
                                 if k.startswith("eval/")}}
          for r in metrics.read_metrics(workdir) if "eval/accuracy" in r]


def warm_start(variant: str) -> dict:
  arg = f"task=multihop,{_FLAG[_SIZE.value]},variant={variant}"
  workdir = os.path.join(_WORKDIR.value, f"sft-{variant}")
  c = sft_config.get_config(arg)
  wall = _timed(workdir, lambda: sft.train_sft(c, workdir))
  rec = dict(kind="warm_start", config=f"configs/sft.py:{arg}", variant=variant,
             steps=c.sft.num_steps, wall_s=round(wall, 1), workdir=workdir,
             evals=_evals(workdir))
  logging.info("Warm start %s: %.0f s.", variant, wall)
  return rec


def rl_run(arg: str, init: str) -> dict:
  c = mgrpo_config.get_config(f"{arg},init={init}")
  workdir = os.path.join(_WORKDIR.value, f"{c.variant}_seed{c.seed}")
  wall = _timed(workdir, lambda: colocated.train_and_evaluate(c, workdir))
  steps = [r for r in metrics.read_metrics(workdir) if "time/step_s" in r]
  train = {}
  for key in ("main/overflow", "single/overflow", "sub/overflow", "main/delegations"):
    if any(key in r for r in steps):
      train[key] = float(np.mean([r[key] for r in steps if key in r]))
  rec = dict(kind="rl", config=f"configs/mgrpo.py:{arg},init={init}", variant=c.variant,
             seed=c.seed, steps=c.num_steps, wall_s=round(wall, 1),
             rollout_s=round(sum(r["time/rollout_s"] for r in steps), 1),
             update_s=round(sum(r["time/step_s"] - r["time/rollout_s"] for r in steps), 1),
             workdir=workdir, evals=_evals(workdir), train_means=train)
  logging.info("RL %s: %.0f s, accuracy %s.", arg, wall,
               [round(e["accuracy"], 3) for e in rec["evals"]])
  return rec


def expert_run(variant: str, *, teacher: bool = False) -> dict:
  """The scripted experts under the same budget (no training): noise-free (the ceiling), or
  with `teacher` slipping as often as the warm start's demonstrations do."""
  arg = f"task=multihop,{_FLAG[_SIZE.value]},variant={variant},policy=expert"
  c = mgrpo_config.get_config(arg)
  if teacher:
    c.expert_noise = sft_config.get_config(arg).sft.expert_noise
  workdir = os.path.join(_WORKDIR.value, f"{'teacher' if teacher else 'expert'}-{variant}")
  os.makedirs(workdir, exist_ok=True)
  result = evaluate.run(c, workdir)
  return dict(kind="teacher" if teacher else "expert", config=f"configs/mgrpo.py:{arg}",
              expert_noise=c.expert_noise, variant=variant,
              evals=[{"step": 0, **{k: v for k, v in result.items()
                                    if isinstance(v, (int, float)) and k != "step"}}])


def summarize(records: list[dict]) -> dict:
  """Per variant: mean and 95% t-interval over seeds of every eval metric, by step and final."""
  out = {}
  for variant in dict.fromkeys(r["variant"] for r in records if r["kind"] == "rl"):
    runs = [r for r in records if r["kind"] == "rl" and r["variant"] == variant]
    steps = sorted(set.intersection(*({e["step"] for e in r["evals"]} for r in runs)))
    keys = sorted(set.intersection(*({k for e in r["evals"] for k in e} for r in runs))
                  - {"step"})
    curves = {}
    for key in keys:
      stack = np.array([[next(e[key] for e in r["evals"] if e["step"] == s) for s in steps]
                        for r in runs])
      mean, half = plotting.t_interval(stack)
      curves[key] = dict(mean=mean.round(4).tolist(), ci95=_nan_to_none(half),
                         seeds=stack.round(4).tolist())
    final = {k: dict(mean=v["mean"][-1], ci95=v["ci95"][-1], seeds=[s[-1] for s in v["seeds"]])
             for k, v in curves.items()}
    # What RL added to the warm start: final minus first evaluation, seed by seed.
    gain = {k: [s[-1] - s[0] for s in curves[k]["seeds"]] for k in _accuracy_keys(curves)}
    out[variant] = dict(seeds=[r["seed"] for r in runs], steps=steps, curves=curves,
                        final=final, gain=_difference_intervals(gain),
                        train_means={k: float(np.mean([r["train_means"][k] for r in runs]))
                                     for k in runs[0]["train_means"]})
  if "mgrpo" in out:
    for variant, s in out.items():
      if variant != "mgrpo":
        s["mgrpo_minus"] = _difference_intervals(_mgrpo_minus(out["mgrpo"], s))
  return out


def _accuracy_keys(curves: dict) -> list[str]:
  return [k for k in curves if k == "accuracy" or k.startswith("accuracy_hops")]


def _mgrpo_minus(mgrpo: dict, other: dict) -> dict[str, list[float]]:
  """M-GRPO's final accuracy minus `other`'s, per key, over the seeds both ran."""
  out = {}
  for key in _accuracy_keys(other["curves"]):
    if key in mgrpo["curves"]:
      mine, theirs = ({seed: s[-1] for seed, s in zip(v["seeds"], v["curves"][key]["seeds"])}
                      for v in (mgrpo, other))
      out[key] = [mine[k] - theirs[k] for k in sorted(mine.keys() & theirs.keys())]
  return out


def _difference_intervals(diffs: dict[str, list[float]]) -> dict:
  """Mean and 95% t-interval of each key's per-seed differences: an interval that excludes 0
  says the difference is beyond seed noise."""
  out = {}
  for key, diff in diffs.items():
    if diff:
      mean, half = plotting.t_interval(np.asarray(diff)[:, None])
      out[key] = dict(mean=round(float(mean[0]), 4), ci95=_nan_to_none(half)[0],
                      seeds=[round(d, 4) for d in diff])
  return out


def _nan_to_none(x: np.ndarray) -> list:
  return [None if not np.isfinite(v) else round(float(v), 4) for v in x]


def plot(records: list[dict], out_png: str) -> str:
  runs = {f"{r['variant']}_seed{r['seed']}": [{"step": e["step"], **{f"eval/{k}": v
                                                                     for k, v in e.items()}}
                                              for e in r["evals"]]
          for r in records if r["kind"] == "rl"}
  keys = sorted({k for recs in runs.values() for e in recs for k in e
                 if k == "eval/accuracy" or k.startswith("eval/accuracy_hops")})
  return plotting.plot_curves(runs, keys, out_png, group_by="_seed", band="t95", ncols=3,
                              title=f"Held-out accuracy, multi-hop task ({_SIZE.value}); "
                                    "mean and 95% t-interval over seeds")


def _write(records: list[dict], path: str, wall_s: float) -> None:
  out = dict(
      command=f"python benchmarks/hierarchy_sweep.py --size={_SIZE.value} "
              f"--seeds={_SEEDS.value}" + (" --reuse" if _REUSE.value else ""),
      # This invocation's time, and the sum of every warm start's and run's own wall time
      # (with --reuse, runs finished by an earlier invocation count their original time).
      wall_s=round(wall_s, 1), runs_wall_s=round(sum(r.get("wall_s", 0) for r in records), 1),
      machine=dict(cpus=os.cpu_count(), platform=platform.platform(), jax=jax.__version__,
                   devices=str(jax.devices()),
                   loadavg_at_end=[round(x, 2) for x in os.getloadavg()]),
      note="Greedy held-out accuracy; intervals are mean +- t_{0.975, n-1} * sd / sqrt(n) over "
           "seeds. Wall times include compilation and evaluation.",
      summary=summarize(records), runs=records)
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  with open(path, "w") as f:
    json.dump(out, f, indent=1)


def _table(summary: dict) -> str:
  lines = []
  for variant, s in summary.items():
    f = s["final"]
    cell = lambda k: (f"{f[k]['mean']:.3f}" + (f" +- {f[k]['ci95']:.3f}" if f[k]["ci95"]
                                                is not None else "")) if k in f else "-"
    hops = "  ".join(f"h{k[-1]} {cell(k)}" for k in sorted(f) if k.startswith("accuracy_hops"))
    lines.append(f"{variant:10s} step {s['steps'][-1]}: accuracy {cell('accuracy')}  {hops}  "
                 f"overflow {cell('overflow')}  delegations {cell('delegations')}")
    for name in ("gain", "mgrpo_minus"):
      if "accuracy" in s.get(name, {}):
        d = s[name]["accuracy"]
        half = f" +- {d['ci95']:.3f}" if d["ci95"] is not None else ""
        lines.append(f"{'':10s} {name}: {d['mean']:+.3f}{half} (per seed {d['seeds']})")
  return "\n".join(lines)


def main(argv):
  del argv
  logging.set_verbosity(logging.INFO)
  # A smoke run proves the pipeline, it measures nothing: its JSON stays in the workdir.
  results = _WORKDIR.value if _SIZE.value == "smoke" else "benchmarks/results"
  out = _OUT.value or os.path.join(results, f"hierarchy-sweep-{_SIZE.value}.json")
  out_png = _PLOT.value or os.path.splitext(out)[0] + ".png"
  args = list(mgrpo_config.hierarchy_sweep(_SIZE.value, _SEEDS.value))
  if _ONLY.value:
    args = [a for a in args if any(f"variant={v}," in a for v in _ONLY.value)]
  t0 = time.perf_counter()
  records = [expert_run(v, teacher=t) for t in (False, True) for v in ("mgrpo", "single")]
  inits = {}
  for arg in args:
    variant = mgrpo_config.get_config(arg).variant
    if WARM_START[variant] not in inits:
      rec = warm_start(WARM_START[variant])
      records.append(rec)
      inits[WARM_START[variant]] = rec["workdir"]
    records.append(rl_run(arg, inits[WARM_START[variant]]))
    _write(records, out, time.perf_counter() - t0)
  print(f"Sweep ({_SIZE.value}, {_SEEDS.value} seeds): {time.perf_counter() - t0:.0f} s. "
        f"{out}, {plot(records, out_png)}")
  for r in records:
    if r["kind"] != "rl":
      print(f"{r['kind']:10s} {r['variant']:10s} accuracy "
            f"{[round(e['accuracy'], 3) for e in r['evals']]} ({r.get('wall_s', 0):.0f} s)")
  print(_table(summarize(records)))


if __name__ == "__main__":
  app.run(main)
