"""Peak memory and time of one multihop evaluation by the reference attention's score budget.

An evaluation runs hundreds of rows through the sampler at once; the reference attention
materialised the whole batch's float32 scores until `attention.REFERENCE_MAX_SCORE_BYTES`
made it run over chunks of queries. Each budget runs in a fresh process (its
peak resident memory is its own): greedy episodes of a run's final agents on the CPU
multihop task's validation questions (`runs.question_log`), the per-question
answers compared across budgets.

  python -m experiments.hierarchy_ablation.eval_memory --init=/work/hier7/rl-short-s1 \
      --memory_out=experiments/hierarchy_ablation/results/eval-memory-cpu.json
"""

import json
import os
import platform
import resource
import subprocess
import sys
import time

from absl import app, flags

UNCHUNKED = 1 << 62


def _child(budget: int) -> None:
  from configs import mgrpo as mgrpo_config
  from experiments.hierarchy_ablation import runs
  from mgrpo_jax.models import attention

  attention.REFERENCE_MAX_SCORE_BYTES = budget or UNCHUNKED
  c = mgrpo_config.get_config(f"task=multihop,runlocal,variant=mgrpo,init={_INIT.value}")
  c.eval_split = "valid"
  t0 = time.perf_counter()
  log = runs.question_log(c)
  print(json.dumps(dict(wall_s=round(time.perf_counter() - t0, 1),
                        peak_rss_gb=round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
                                          / 2**20, 2),
                        accuracy=log["accuracy"], correct=log["correct"])))


def main(argv):
  del argv
  if _CHILD.value >= 0:
    return _child(_CHILD.value)
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  env = {**os.environ, "JAX_PLATFORMS": "cpu",
         "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
  rows, answers = [], None
  for budget in map(int, _BUDGETS.value):
    proc = subprocess.run([sys.executable, "-m", __spec__.name, f"--init={_INIT.value}",
                           f"--child_budget={budget}"], env=env, capture_output=True,
                          text=True, check=True)
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    answers = r["correct"] if answers is None else answers
    rows.append(dict(budget_bytes=budget or None, wall_s=r["wall_s"],
                     peak_rss_gb=r["peak_rss_gb"], accuracy=r["accuracy"],
                     same_answers_as_first=r["correct"] == answers))
    print(rows[-1], flush=True)
  out = dict(what=__doc__.split("\n\n")[0], init=_INIT.value, machine=platform.processor()
             or platform.machine(), cpus=os.cpu_count(), results=rows,
             command=" ".join(["python"] + sys.argv))
  if _OUT.value:
    with open(_OUT.value, "w") as f:
      json.dump(out, f, indent=1)
      f.write("\n")


if __name__ == "__main__":
  # Flags only when run: tests and other modules import this one's functions.
  _INIT = flags.DEFINE_string("init", None, "A main + sub run's workdir (its hf/ weights).",
                              required=True)
  _BUDGETS = flags.DEFINE_list("budgets", ["0", str(64 << 20), str(256 << 20), str(1 << 30)],
                               "Score budgets in bytes; 0 = unchunked (the whole batch).")
  _OUT = flags.DEFINE_string("memory_out", "", "Results JSON (default: print only).")
  _CHILD = flags.DEFINE_integer("child_budget", -1, "Internal: evaluate once at this budget.")
  app.run(main)
