"""The CPU demo of M-GRPO: warm start, then RL; held-out accuracy before and after.

  python benchmarks/mgrpo_demo.py                # warm start + M-GRPO, seed 0
  python benchmarks/mgrpo_demo.py --sweep        # + frozen sub-agent and single agent, 3 seeds

Runs `configs/sft.py:runlocal` (the warm start: SFT on the scripted experts' traces) and then
`configs/mgrpo.py:runlocal,init=<warm start>` through the library, exactly what
`launch/train.py` runs. With `--sweep` it runs `configs/mgrpo.py:sweep()`: M-GRPO, frozen
sub-agent and single agent (which needs its own warm start: one agent with every tool) for
3 seeds each, every seed from the same warm start, and evaluates the scripted experts as the
upper bound. Accuracy is greedy, on the same held-out
questions at step 0 (the warm start) and after the last step. Writes one record per run to
`--out` (default benchmarks/results/mgrpo-demo-cpu-world.json).
"""

import json
import os
import platform
import shutil
import time

import jax
from absl import app, flags, logging

from configs import mgrpo as mgrpo_config
from configs import sft as sft_config
from mgrpo_jax import evaluate
from mgrpo_jax.mgrpo import colocated, sft

_WORKDIR = flags.DEFINE_string("workdir", "/tmp/mgrpo_demo", "Runs go to subfolders (replaced).")
_OUT = flags.DEFINE_string("out", "benchmarks/results/mgrpo-demo-cpu-world.json",
                           "Results JSON.")
_SWEEP = flags.DEFINE_bool("sweep", False, "Run configs/mgrpo.py:sweep() (3 variants x 3 seeds).")
_ONLY = flags.DEFINE_list("only", None, "Run only these variants of the sweep (e.g. single).")
_REUSE = flags.DEFINE_bool("reuse_warm_start", False,
                           "Use a finished warm start already in --workdir instead of rerunning it.")


def _read_metrics(workdir: str) -> list[dict]:
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f if line.strip()]


def _eval_record(rows: list[dict]) -> dict:
  """Held-out accuracy (and format rate) at the first and the last evaluation."""
  evals = [r for r in rows if "eval/accuracy" in r]
  first, last = evals[0], evals[-1]
  return dict(
      step_first=first["step"], accuracy_first=first["eval/accuracy"],
      format_first=first["eval/format"], step_last=last["step"],
      accuracy_last=last["eval/accuracy"], format_last=last["eval/format"],
      curve=[(r["step"], r["eval/accuracy"]) for r in evals])


def _fresh(path: str) -> str:
  shutil.rmtree(path, ignore_errors=True)  # A demo measures a run from scratch, never a resume.
  return path


def warm_start(variant: str) -> dict:
  """SFT for `variant`'s agents (main + sub, or the single agent)."""
  arg = f"runlocal,variant={variant}"
  c = sft_config.get_config(arg)
  workdir = os.path.join(_WORKDIR.value, f"sft-{variant}")
  wall_json = os.path.join(workdir, "wall.json")
  if _REUSE.value and os.path.exists(wall_json):
    with open(wall_json) as f:
      wall = json.load(f)["wall_s"]
  else:
    _fresh(workdir)
    t0 = time.perf_counter()
    sft.train_sft(c, workdir)
    wall = time.perf_counter() - t0
    with open(wall_json, "w") as f:
      json.dump({"wall_s": wall}, f)
  rec = dict(kind="warm_start", config=f"configs/sft.py:{arg}", variant=variant, seed=c.seed,
             steps=c.sft.num_steps, wall_s=round(wall, 1), workdir=workdir)
  rec.update(_eval_record(_read_metrics(workdir)))
  logging.info("Warm start %s: %s", variant, rec)
  return rec


def rl_run(arg: str, init: str) -> dict:
  """One RL run of configs/mgrpo.py:`arg` from the warm start in `init`."""
  c = mgrpo_config.get_config(f"{arg},init={init}")
  name = arg.replace("runlocal,", "").replace(",", "-").replace("=", "")
  workdir = _fresh(os.path.join(_WORKDIR.value, name))
  t0 = time.perf_counter()
  colocated.train_and_evaluate(c, workdir)
  wall = time.perf_counter() - t0
  rows = _read_metrics(workdir)
  steps = [r for r in rows if "time/step_s" in r]
  rec = dict(kind="rl", config=f"configs/mgrpo.py:{arg},init={init}", variant=c.variant,
             seed=c.seed, steps=c.num_steps, wall_s=round(wall, 1),
             rollout_s=round(sum(r["time/rollout_s"] for r in steps), 1),
             update_s=round(sum(r["time/step_s"] - r["time/rollout_s"] for r in steps), 1),
             workdir=workdir)
  rec.update(_eval_record(rows))
  logging.info("RL %s: %s", arg, rec)
  return rec


def expert_run() -> dict:
  """The scripted experts (noise-free) on the same held-out questions: the upper bound."""
  arg = "runlocal,policy=expert"
  workdir = _fresh(os.path.join(_WORKDIR.value, "expert"))
  t0 = time.perf_counter()
  result = evaluate.run(mgrpo_config.get_config(arg), workdir)
  return dict(kind="expert", config=f"configs/mgrpo.py:{arg}", variant="expert", seed=0,
              steps=0, wall_s=round(time.perf_counter() - t0, 1), workdir=workdir,
              accuracy_first=result["accuracy"], accuracy_last=result["accuracy"],
              format_last=result["format"])


def _write(records: list[dict]) -> None:
  load = os.getloadavg()
  out = dict(
      command="python benchmarks/mgrpo_demo.py" + (" --sweep" if _SWEEP.value else ""),
      machine=dict(cpus=os.cpu_count(), platform=platform.platform(), jax=jax.__version__,
                   devices=str(jax.devices()), loadavg_at_end=[round(x, 2) for x in load]),
      note="Wall times include JIT compilation and evaluation; the CPU was shared with other "
           "jobs, see loadavg_at_end.",
      runs=records)
  os.makedirs(os.path.dirname(_OUT.value) or ".", exist_ok=True)
  with open(_OUT.value, "w") as f:
    json.dump(out, f, indent=1)
  logging.info("Wrote %s.", _OUT.value)


def main(argv):
  del argv
  logging.set_verbosity(logging.INFO)
  args = list(mgrpo_config.sweep()) if _SWEEP.value else ["runlocal,variant=mgrpo,seed=0"]
  if _ONLY.value:
    args = [a for a in args if any(f"variant={v}," in a + "," for v in _ONLY.value)]
  records, inits = ([expert_run()] if _SWEEP.value else []), {}
  for arg in args:
    variant = mgrpo_config.get_config(arg).variant
    # frozen_sub starts from the same two agents as mgrpo; single needs its own warm start.
    needs = "single" if variant == "single" else "mgrpo"
    if needs not in inits:
      rec = warm_start(needs)
      records.append(rec)
      inits[needs] = rec["workdir"]
    records.append(rl_run(arg, inits[needs]))
    _write(records)
  for r in records:
    print(f"{r['kind']:10s} {r['variant']:10s} seed {r['seed']}  accuracy "
          f"{r['accuracy_first']:.3f} -> {r['accuracy_last']:.3f}  ({r['wall_s']:.0f} s)")


if __name__ == "__main__":
  app.run(main)
