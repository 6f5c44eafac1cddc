"""The MAGRPO CPU demo and its baselines, measured: held-out success before and after RL.

  python benchmarks/magrpo_demo.py --out=benchmarks/results/magrpo-demo-cpu.json

Runs `configs/magrpo.py:runlocal` (two tiny agents, warm start, then MAGRPO on the generated
`pick` task) for 3 seeds, the single-model baseline (`variant=single`), and the untrained
pipelines of the paper's comparison (`sequential`, and `discussion` over 2 turns) from the
same warm start. Each row: held-out success (`eval/accuracy`: both picks valid and
different) and joint reward at step 0 (after the warm start) and at the end, and wall time.
"""

import json
import os
import platform
import tempfile
import time

import jax
from absl import app, flags

from configs import magrpo as magrpo_config
from mgrpo_jax import metrics as metrics_lib
from mgrpo_jax.magrpo import program as magrpo_program

_OUT = flags.DEFINE_string("out", "benchmarks/results/magrpo-demo-cpu.json", "JSON output.")
_SEEDS = flags.DEFINE_integer("seeds", 3, "Seeds of the MAGRPO runs.")
_WORKDIR = flags.DEFINE_string("workdir", "", "Where runs go (default: a temp dir).")
_RUNS = flags.DEFINE_list("runs", [], "Names of RUNS to run (default: all); their rows "
                          "replace those in an existing --out.")

RUNS = [("magrpo", "runlocal,seed={seed}", None),
        ("single", "runlocal,variant=single,seed=0", None),
        ("untrained-parallel", "runlocal,seed=0", 0),
        ("untrained-sequential", "runlocal,pipeline=sequential,seed=0", 0),
        ("untrained-discussion", "runlocal,pipeline=discussion,turns=2,seed=0", 0)]


def _run(arg: str, num_steps, workdir: str) -> dict:
  c = magrpo_config.get_config(arg)
  if num_steps is not None:
    c.num_steps = num_steps
  t0 = time.perf_counter()
  magrpo_program.train_and_evaluate(c, workdir)
  wall = time.perf_counter() - t0
  evals = [r for r in metrics_lib.read_metrics(workdir) if "eval/accuracy" in r]
  first, last = evals[0], evals[-1]
  return {"config": arg, "num_steps": c.num_steps,
          "warm_start_steps": c.warm_start.num_steps,
          "success_before": first["eval/accuracy"], "success_after": last["eval/accuracy"],
          "reward_before": first["eval/reward"], "reward_after": last["eval/reward"],
          "format_after": last["eval/format"], "num_eval": c.num_eval,
          "curve": [(r["step"], r["eval/accuracy"]) for r in evals],
          "wall_s": round(wall, 1)}


def _write(rows: list) -> None:
  result = {"benchmark": "magrpo_demo", "device": str(jax.devices()[0]),
            "cpu_count": os.cpu_count(), "machine": platform.machine(),
            "command": "python benchmarks/magrpo_demo.py", "runs": rows}
  os.makedirs(os.path.dirname(_OUT.value) or ".", exist_ok=True)
  with open(_OUT.value + ".tmp", "w") as f:
    json.dump(result, f, indent=2)
  os.replace(_OUT.value + ".tmp", _OUT.value)


def main(argv):
  del argv
  root = _WORKDIR.value or tempfile.mkdtemp(prefix="magrpo_demo_")
  wanted = set(_RUNS.value) or {name for name, _, _ in RUNS}
  rows = []
  if _RUNS.value and os.path.exists(_OUT.value):
    with open(_OUT.value) as f:
      rows = [r for r in json.load(f)["runs"] if r["name"] not in wanted]
  for name, template, steps in RUNS:
    if name not in wanted:
      continue
    seeds = range(_SEEDS.value) if "{seed}" in template else [0]
    for seed in seeds:
      arg = template.format(seed=seed)
      row = dict(name=name, seed=seed, **_run(arg, steps, os.path.join(root, f"{name}-{seed}")))
      print(json.dumps({k: v for k, v in row.items() if k != "curve"}), flush=True)
      rows.append(row)
      _write(rows)  # After every run: a crash loses at most the run in progress.
  print(f"Wrote {_OUT.value}")


if __name__ == "__main__":
  app.run(main)
