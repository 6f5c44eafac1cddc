"""The hierarchy ablation's sweep: warm starts, RL runs and baselines, into one results JSON.

  python -m experiments.hierarchy_ablation.sweep --size=cpu --instrument   # cheap figures, ~1 min
  python -m experiments.hierarchy_ablation.sweep --size=cpu --only=mgrpo,frozen_sub --seeds=4 \
      --seed_start=0 --workdir=/tmp/hier --reuse                          # one share of a sweep
  python -m experiments.hierarchy_ablation.sweep --size=cpu --warm_starts --workdir=/tmp/hier \
      --archive=/data/warm-starts                                         # the warm starts only
  python -m experiments.hierarchy_ablation.sweep --size=smoke --seeds=1 --workdir=/tmp/hs
  python -m experiments.hierarchy_ablation.sweep --size=gpu --workdir=/w  # one H100/H200

The protocol is README.md's. A sweep may be split over invocations by `--only` and
`--seed_start`/`--seeds`; `--reuse` keeps the runs whose config and commit are this
invocation's, resumes unfinished ones, and the JSON at `--out` merges every invocation's runs
(each listed in `invocations`). `--only=none` runs nothing and writes the summary, verdict and
plot again. Warm starts are not kept in git: `--warm_starts` makes them (or restores them from
`--archive`, a folder the user names: a persistent disk, or a copy fetched from the machine
that made them) and archives the finished ones there.
"""

import json
import os
import sys
import time

from absl import app, flags, logging

from configs import mgrpo as mgrpo_config
from experiments.hierarchy_ablation import config as ablation
from experiments.hierarchy_ablation import instrument as hi
from experiments.hierarchy_ablation import runs, summary
from mgrpo_jax import compile_cache
from mgrpo_jax.mgrpo import tasks

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")

_SIZE = flags.DEFINE_enum("size", "cpu", ["cpu", "gpu", "smoke"], "Task size.")
_SEEDS = flags.DEFINE_integer("seeds", 0, "Seeds per variant (0: the power analysis's number).")
_WORKDIR = flags.DEFINE_string("workdir", "/tmp/hierarchy_sweep", "Runs go to subfolders.")
_OUT = flags.DEFINE_string("out", "", "Results JSON (default results/hierarchy-heldout-<size>"
                           ".json, hierarchy-heldout-valid-<size>.json with --eval_split=valid; "
                           "smoke: in --workdir).")
_PLOT = flags.DEFINE_string("plot", "", "Curves PNG (default: --out with .png).")
_ONLY = flags.DEFINE_list("only", None, "Run only these variants or controls (e.g. mgrpo,"
                          "frozen_sub,single_full_context); 'none' runs nothing and only "
                          "summarizes --out again (and redraws its plot).")
_REUSE = flags.DEFINE_bool("reuse", False, "Keep finished warm starts and runs in --workdir "
                           "and resume unfinished ones (refused when a run's config or the "
                           "code's commit changed).")
_REUSE_ANY_COMMIT = flags.DEFINE_bool("reuse_any_commit", False, "With --reuse: keep runs made "
                                      "at another commit (their config must still match).")
_SEED_START = flags.DEFINE_integer("seed_start", 0, "First seed: this invocation runs seeds "
                                   "[seed_start, seed_start + seeds).")
_EVAL_SPLIT = flags.DEFINE_enum("eval_split", "test", ["test", "valid"], "Which held-out split "
                                "runs evaluate: test for the table, valid for tuning and "
                                "timing runs (the test split stays unseen).")
_TIMING = flags.DEFINE_string("timing", "", "With --instrument: a sweep JSON of one timed run "
                              "whose wall times size the sessions (session_budget).")
_ARCHIVE = flags.DEFINE_string("archive", "", "A folder where finished warm starts are kept "
                               "(archive.py) and restored from with --reuse: a persistent "
                               "disk, or one fetched from the run that made them ('': none).")
_WARM_STARTS = flags.DEFINE_bool("warm_starts", False, "Only make (or restore) the warm starts "
                                 "of the chosen variants, and archive them.")
_INSTRUMENT = flags.DEFINE_bool("instrument", False, "Only the cheap measurements (no training): "
                                "splits, leaks, the no-tool guesser, the teacher, the power "
                                "analysis; writes hierarchy-instrument-<size>.json.")


def _chosen(seeds: int) -> list[tuple[str, str]]:
  """(variant or control, config argument) of every run this invocation makes."""
  args = [(mgrpo_config.get_config(a).variant, a) for a in ablation.hierarchy_sweep(
      _SIZE.value, seeds, seed_start=_SEED_START.value)]
  args += list(ablation.hierarchy_controls(_SIZE.value, seeds, seed_start=_SEED_START.value))
  if _ONLY.value:
    names = list(dict.fromkeys(name for name, _ in args))
    unknown = sorted(set(_ONLY.value) - set(names) - {"none"})
    if unknown:
      raise app.UsageError(f"--only: unknown {', '.join(map(repr, unknown))}; the sweep's "
                           f"variants and controls are {', '.join(names)} (or 'none')")
    args = [(name, a) for name, a in args if name in _ONLY.value]
  return args


def main(argv):
  del argv
  logging.set_verbosity(logging.INFO)
  # As the launchers: a run compiles only the step shapes no earlier run of the sweep did.
  compile_cache.enable_from_flags()
  hi.git_commit()  # Pinned now: the commit of the code this process runs.
  opts = runs.Options(size=_SIZE.value, workdir=_WORKDIR.value, eval_split=_EVAL_SPLIT.value,
                      reuse=_REUSE.value, reuse_any_commit=_REUSE_ANY_COMMIT.value)
  # A smoke run proves the pipeline, it measures nothing: its JSON stays in the workdir.
  results = _WORKDIR.value if _SIZE.value == "smoke" else RESULTS
  if _INSTRUMENT.value:
    path = _OUT.value or os.path.join(results, f"hierarchy-instrument-{_SIZE.value}.json")
    out = hi.instrument(path, _SIZE.value, _WORKDIR.value, timing=_TIMING.value,
                        command=" ".join([summary.ENTRY] + sys.argv[1:]))
    print(json.dumps({k: out[k] for k in ("splits", "power_analysis")}, indent=1))
    for r in out["baselines"]:
      print(f"{r['kind']:10s} {r['variant']:10s} accuracy {r['evals'][0]['accuracy']}")
    return
  split = "" if _EVAL_SPLIT.value == "test" else f"{_EVAL_SPLIT.value}-"
  out = _OUT.value or os.path.join(results, f"hierarchy-heldout-{split}{_SIZE.value}.json")
  summary.check_split(out, _EVAL_SPLIT.value)  # Before hours of runs, not after.
  out_png = _PLOT.value or os.path.splitext(out)[0] + ".png"
  probe = mgrpo_config.get_config(f"task=multihop,{ablation.SIZE_FLAG[_SIZE.value]}")
  probe.eval_split = _EVAL_SPLIT.value
  env = tasks.build_env(probe)
  first_page = hi.first_pages(tasks.eval_questions(probe, env))
  power = hi.power_analysis(min(probe.num_eval_questions, len(env.test)))
  seeds = _SEEDS.value or power["seeds"]
  args = _chosen(seeds)
  if _WARM_STARTS.value:
    for variant in dict.fromkeys(ablation.WARM_START[name] for name, _ in args):
      rec = runs.warm_start(opts, variant, _ARCHIVE.value)
      print(f"warm start {variant}: {rec['workdir']} (digest {rec['digest']})")
    return
  t0, started = time.perf_counter(), time.time()
  records = hi.baselines(_SIZE.value, _EVAL_SPLIT.value, _WORKDIR.value)
  inits = {}
  for variant, arg in args:
    family = ablation.WARM_START[variant]
    if family not in inits:
      inits[family] = runs.warm_start(opts, family, _ARCHIVE.value)
      records.append(inits[family])
      if family == "mgrpo":
        records.append(runs.closed_book_run(opts, inits[family], summary.earlier_runs(out)))
    records.append(runs.rl_run(opts, arg, inits[family], name=variant))
    summary.write(records, out, time.perf_counter() - t0, power, first_page, opts=opts,
                  started=started)
  merged = summary.write(records, out, time.perf_counter() - t0, power, first_page, opts=opts,
                         started=started)
  # Every invocation's runs, not only this one's: the curves are the sweep's so far.
  print(f"Sweep ({_SIZE.value}, seeds {_SEED_START.value}..{_SEED_START.value + seeds - 1}): "
        f"{time.perf_counter() - t0:.0f} s. {out}, {summary.plot(merged, out_png, _SIZE.value)}")
  for r in records:
    if r["kind"] != "rl":
      print(f"{r['kind']:10s} {r['variant']:10s} accuracy "
            f"{[e.get('accuracy') for e in r['evals']]} ({r.get('wall_s', 0):.0f} s)")
  with open(out) as f:
    written = json.load(f)
  print(written["verdict"]["reason"])
  if written["verdict"]["informative"] is not False:
    print(summary.table(written["summary"]))


if __name__ == "__main__":
  app.run(main)
