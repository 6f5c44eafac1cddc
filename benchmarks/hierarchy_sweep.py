"""The hierarchy ablation on multi-hop research over long pages (algorithm.md 1.7, issues 18, 32).

  python benchmarks/hierarchy_sweep.py --size=cpu --instrument   # the cheap figures, ~1 min
  python benchmarks/hierarchy_sweep.py --size=cpu --only=mgrpo,frozen_sub --seeds=4 \
      --seed_start=0 --workdir=/tmp/hier --reuse                  # one session's share
  python benchmarks/hierarchy_sweep.py --size=smoke --seeds=1 --workdir=/tmp/hs # end to end
  python benchmarks/hierarchy_sweep.py --size=cpu --only=none --workdir=/tmp/hier --reuse
      # runs nothing: the JSON's summary, verdict and plot made again from its runs
  python benchmarks/hierarchy_sweep.py --size=gpu --workdir=/w   # one H100/H200

The protocol (docs/hierarchy-ablation.md), fixed before the runs: the task holds out whole
chains of entities (validation and test splits; the test split serves the table only, every
tuning choice uses `eval_split="valid"`); the number of seeds comes from `power_analysis`
(80% power for a 5-point paired difference between M-GRPO and frozen_sub, unit = seed);
evaluations answer every test question. Runs `configs/mgrpo.py:hierarchy_sweep(size)`:
M-GRPO, frozen sub-agent, shared weights, single agent with every tool and M-GRPO without
trajectory alignment (`unaligned`), and `hierarchy_controls`: the single agent whose context
holds every page (`single_full_context`). Each set of agents gets one SFT warm start on the
experts' traces (`configs/sft.py` with the same arguments): main + sub (shared by mgrpo,
frozen_sub and unaligned), one model for `shared`, the single agent (correct demonstrations
only), its full-context control; every seed starts from its variant's warm start. Beside
them, baselines that read nothing: the no-tool guesser (`envs.multihop.no_tool_guesser`) and
the main + sub warm start with every tool disabled (`closed_book`); and the scripted experts,
noise-free (the ceiling) and slipping as the warm start's teacher does (`teacher`).

A sweep is split over sessions by `--only` and `--seed_start`/`--seeds`: each run's
done.json keeps its config and commit, `--reuse` keeps only runs whose config and commit are
this invocation's (and names what differs otherwise) and resumes a run that an invocation
left unfinished (progress.json) from its checkpoints, and the JSON merges the runs of every
invocation into `--out`, each invocation recorded in `invocations`. A session's machine may
be new: finished warm starts are kept in `--archive` (committed with the JSON; an unfinished
one is archived by hand, `benchmarks/sweep_archive.py`), restored from there by `--reuse`;
runs record the digest of the warm start they began from, and runs from a warm start made
again are set aside (`other_warm_start_runs`). Greedy evaluations of the same weights are
made once: a run copies the step-0 evaluation of another seed or variant of its warm start
and config, made at the same commit (any with --reuse_any_commit; `evaluated_start`,
recorded as `start_evaluation_from`), and with --reuse an invocation keeps the closed-book
record an earlier one made (`closed_book_run`).

Writes `--out` (JSON): per run, the evaluations at every evaluation step (accuracy overall
and by pages needed `hops<n>`; context overflow rate; delegations per episode), the final
weights' correctness per question and per sub-agent call, its config, commit and time; per
variant, the mean and the 95% t-interval over seeds of each of those at each step and at the
end; what RL added to each warm start and M-GRPO's lead over each variant, seed by seed,
with 95% t-intervals; the power analysis; and the `verdict`: unless M-GRPO beats the best
baseline that reads nothing by 5 points, the instrument is uninformative and the table
ranks nothing. And `--plot` (PNG): accuracy by step, mean and 95% t-interval per variant.
"""

import dataclasses
import glob
import json
import os
import platform
import shutil
import sys
import threading
import time
from typing import Sequence

import jax
import numpy as np
from absl import app, flags, logging

from configs import mgrpo as mgrpo_config
from configs import sft as sft_config
from mgrpo_jax import compile_cache, keys, metrics, plotting, sharding
from mgrpo_jax import workdir as workdir_lib
from mgrpo_jax.mgrpo import colocated, play, setup, sft, tasks
from mgrpo_jax.mgrpo import hierarchy

import hierarchy_instrument as hi  # benchmarks/hierarchy_instrument.py
import sweep_archive  # benchmarks/sweep_archive.py

_SIZE = flags.DEFINE_enum("size", "cpu", ["cpu", "gpu", "smoke"], "Task size (configs/mgrpo.py).")
_SEEDS = flags.DEFINE_integer("seeds", 0, "Seeds per variant (0: the power analysis's number).")
_WORKDIR = flags.DEFINE_string("workdir", "/tmp/hierarchy_sweep", "Runs go to subfolders.")
_OUT = flags.DEFINE_string("out", "", "Results JSON (default benchmarks/results/"
                           "hierarchy-heldout-<size>.json, hierarchy-heldout-valid-<size>.json "
                           "with --eval_split=valid; smoke: in --workdir).")
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
                                   "[seed_start, seed_start + seeds) (split a sweep over "
                                   "sessions; --reuse and the same --out merge them).")
_EVAL_SPLIT = flags.DEFINE_enum("eval_split", "test", ["test", "valid"], "Which held-out split "
                                 "runs evaluate: test for the table, valid for tuning and "
                                 "timing runs (the test split stays unseen).")
_TIMING = flags.DEFINE_string("timing", "", "With --instrument: a sweep JSON of one timed run "
                               "(e.g. --only=mgrpo --seeds=1 --eval_split=valid) whose wall "
                               "times size the sessions (session_budget).")
_ARCHIVE = flags.DEFINE_string("archive", None, "Where finished warm starts are kept for a "
                               "later session's machine (sweep_archive.py); default: --out "
                               "without .json, plus -warm-starts; 'none': nowhere.")
_INSTRUMENT = flags.DEFINE_bool("instrument", False, "Only the cheap measurements (no training): "
                                "splits, leaks, the no-tool guesser, the teacher, the power "
                                "analysis; writes hierarchy-instrument-<size>.json.")

_FLAG, EXTRA = hi.SIZE_FLAG, hi.EXTRA
# The warm start each variant starts from: variants with the same agents share one.
WARM_START = {"mgrpo": "mgrpo", "frozen_sub": "mgrpo", "unaligned": "mgrpo",
              "shared": "shared", "single": "single",
              "single_full_context": "single_full_context"}
# A control and the variant it controls for: the summary pairs them by seed, as it does
# M-GRPO and each other variant (Deliver 3: does the single agent's short context cost it?).
CONTROLS = {"single_full_context": "single"}
# Re-exported: the sweep's JSON and tests read them here.
git_commit, power_analysis, paired_t_power = hi.git_commit, hi.power_analysis, hi.paired_t_power
session_budget, EFFECT = hi.session_budget, hi.EFFECT


def config_record(c) -> dict:
  """A run's resolved config as JSON values (what --reuse compares)."""
  return json.loads(c.to_json_best_effort(sort_keys=True))


# Fields of the RL config that a warm start never reads (configs/sft.py builds on the RL
# config): a warm start made under other RL defaults is still this sweep's.
WARM_START_IGNORES = ("rl_worlds", "rl_hop_weights", "num_queries", "num_steps", "eval_every")


def check_reusable(done: dict, config: dict, commit: str, *, any_commit: bool = False,
                   what: str = "finished run", ignore: tuple = ()) -> None:
  """Raises ValueError naming what differs when a finished run (its done.json; or an
  unfinished one's progress.json) was made with another config or at another commit than this
  invocation's: such a run is not this sweep's. `ignore`: fields the run does not read."""
  differ = {k: v for k, v in workdir_lib.differences(done.get("config", {}), config).items()
            if k not in ignore}
  if differ:
    raise ValueError(f"--reuse refused: the {what}'s config differs in " + "; ".join(
        f"{k}: {old!r} -> {new!r}" for k, (old, new) in list(differ.items())[:10])
        + (f" (and {len(differ) - 10} more)" if len(differ) > 10 else ""))
  if not any_commit and done.get("commit") != commit:
    raise ValueError(f"--reuse refused: the {what} was made at commit "
                     f"{done.get('commit')!r}, this invocation runs {commit!r} "
                     "(--reuse_any_commit keeps it if the change cannot affect it).")


def _write_json(path: str, record: dict) -> None:
  """Writes `record` whole or not at all (an invocation may be killed at any time)."""
  with open(path + ".tmp", "w") as f:
    json.dump(record, f)
  os.replace(path + ".tmp", path)


class _Clock:
  """Wall seconds between ticks, each gap capped at `max_gap_s`: a process stopped between two
  ticks (SIGSTOP, e.g. paused for the test suite) counts at most `max_gap_s` of its pause."""

  def __init__(self, max_gap_s: float, now=time.perf_counter):
    self._max_gap_s, self._now = max_gap_s, now
    self._last, self.seconds = now(), 0.0

  def tick(self) -> float:
    now = self._now()
    self.seconds += min(now - self._last, self._max_gap_s)
    self._last = now
    return self.seconds


def _timed(workdir: str, run, config: dict, *, reuse: bool | None = None,
           any_commit: bool | None = None, heartbeat_s: float = 30.0,
           ignore: tuple = ()) -> float:
  """Runs `run()` in `workdir`, or reuses a finished run; its wall seconds.

  Without --reuse a run starts from scratch. With it, a finished run (done.json) is kept, and
  an unfinished one (progress.json: an invocation stopped mid-run, e.g. at a session's end)
  goes on from its last checkpoint (`run` resumes from `workdir`); both only when their config
  and commit are this invocation's. A resumed run's wall seconds add what the earlier
  invocations spent on it, as of progress.json's last heartbeat (every `heartbeat_s`). Time
  while the process is stopped is not counted, beyond 4 heartbeats a pause (`_Clock`).
  """
  reuse = _REUSE.value if reuse is None else reuse
  any_commit = _REUSE_ANY_COMMIT.value if any_commit is None else any_commit
  marker, progress = (os.path.join(workdir, n) for n in ("done.json", "progress.json"))
  commit = git_commit()
  if reuse and os.path.exists(marker):
    with open(marker) as f:
      done = json.load(f)
    check_reusable(done, config, commit, any_commit=any_commit, ignore=ignore)
    return done["wall_s"]
  before, commits = 0.0, [commit]
  if reuse and os.path.exists(progress):
    with open(progress) as f:
      started = json.load(f)
    check_reusable(started, config, commit, any_commit=any_commit, what="unfinished run",
                   ignore=ignore)
    before = started["wall_s"]
    # Every commit the run was made at, oldest first (one per invocation that changed it).
    commits = started.get("commits") or [started.get("commit", "unknown")]
    commits += [commit] if commits[-1] != commit else []
    logging.info("Resuming the unfinished run in %s (%.0f s so far).", workdir, before)
  else:
    shutil.rmtree(workdir, ignore_errors=True)  # A sweep measures runs from scratch.
    os.makedirs(workdir)
  clock = _Clock(max_gap_s=4 * heartbeat_s)
  record = lambda: {"wall_s": before + clock.tick(), "config": config, "commit": commit,
                    "commits": commits, "resumed_after_s": before}
  stop = threading.Event()

  def heartbeat():
    while not stop.wait(heartbeat_s):
      _write_json(progress, record())

  _write_json(progress, record())
  beat = threading.Thread(target=heartbeat, daemon=True)
  beat.start()
  try:
    run()
  finally:
    stop.set()
    beat.join()
  done = record()
  _write_json(marker, done)
  os.remove(progress)
  return done["wall_s"]


def _run_commits(workdir: str) -> list[str]:
  """Every commit a finished run was made at, oldest first (a run resumed by an invocation at
  another commit has several; a done.json from before they were kept names its last only)."""
  with open(os.path.join(workdir, "done.json")) as f:
    done = json.load(f)
  return done.get("commits") or [done.get("commit", "unknown")]


def _evals(workdir: str) -> list[dict]:
  """The run's evaluations: {"step", and every eval/ metric without its prefix}."""
  return [{"step": r["step"], **{k.removeprefix("eval/"): v for k, v in r.items()
                                 if k.startswith("eval/")}}
          for r in metrics.read_metrics(workdir) if "eval/accuracy" in r]


def warm_start(variant: str, archive: str = "") -> dict:
  """The variant's warm start: made, or reused from the workdir or (with --reuse) from
  `archive`, where a finished one is then kept."""
  arg = f"task=multihop,{_FLAG[_SIZE.value]},{EXTRA[variant]}"
  workdir = os.path.join(_WORKDIR.value, f"sft-{variant}")
  c = sft_config.get_config(arg)
  # The warm start's own evaluations only monitor it (what RL adds is measured from each RL
  # run's first evaluation), so they read the validation split whatever --eval_split says:
  # one warm start then serves a validation (timing) invocation and the test invocations.
  c.eval_split = "valid"
  if archive and _REUSE.value and sweep_archive.restore(archive, workdir):
    logging.info("Warm start %s restored from %s.", variant, archive)
  wall = _timed(workdir, lambda: sft.train_sft(c, workdir), config_record(c),
                ignore=WARM_START_IGNORES)
  if archive and sweep_archive.save(workdir, archive) is None:
    logging.warning("Warm start %s is over %d MiB: not archived; keep --workdir on a "
                    "persistent disk.", variant, sweep_archive.MAX_BYTES // 2**20)
  commits = _run_commits(workdir)
  rec = dict(kind="warm_start", config=f"configs/sft.py:{arg}", variant=variant,
             commit=commits[-1], commits=commits, digest=sweep_archive.digest(workdir),
             steps=c.sft.num_steps, wall_s=round(wall, 1), workdir=workdir,
             evals=_evals(workdir))
  logging.info("Warm start %s: %.0f s.", variant, wall)
  return rec


def _same_start(other: dict, config: dict) -> bool:
  """Whether two runs' configs differ at most in seed and in a variant that shares the warm
  start (the same agents in the same roles; what the variants change is training)."""
  differ = set(workdir_lib.differences(other, config)) - {"seed", "variant"}
  return not differ and WARM_START.get(other.get("variant")) == WARM_START.get(
      config.get("variant"))


def evaluated_start(config: dict, workdir: str) -> str:
  """Another run in --workdir whose evaluation of step 0 a run (`config`, in `workdir`) may
  copy instead of making it again, or "": one of the same warm start (digest) and config but
  for its seed and variant (`_same_start`), evaluated greedily on CPU, begun at this commit
  (any with --reuse_any_commit), that made that evaluation itself and wrote it.

  Every seed of M-GRPO and frozen_sub gave the same step-0 metrics and per-question record
  on CPU (7 runs, sessions 16-19): greedy answers of the same weights to the same questions.
  It took about 4 minutes of each run. On a GPU, autotuning may differ between processes, so
  every run evaluates its own start there.
  """
  if config["eval_sampling"]["temperature"] > 0 or jax.default_backend() != "cpu":
    return ""
  commit = git_commit()
  for marker in sorted(glob.glob(os.path.join(_WORKDIR.value, "*", "*.json"))):
    source = os.path.dirname(marker)
    if (os.path.basename(marker) not in ("done.json", "progress.json")
        or os.path.abspath(source) == os.path.abspath(workdir)):
      continue
    with open(marker) as f:
      run = json.load(f)
    first_commit = (run.get("commits") or [run.get("commit")])[0]
    if (_same_start(run.get("config", {}), config)
        and (_REUSE_ANY_COMMIT.value or first_commit == commit)
        and os.path.exists(play.questions_path(source, 0)) and not play.copied_from(source, 0)
        and any(r["step"] == 0 and "eval/accuracy" in r for r in metrics.read_metrics(source))):
      return source
  return ""


def rl_run(arg: str, init: dict, name: str = "") -> dict:
  """One RL run from the warm start `init` (its record); `name` labels a control (default:
  the config's variant)."""
  c = mgrpo_config.get_config(f"{arg},init={init['workdir']}")
  c.eval_split = _EVAL_SPLIT.value
  name = name or c.variant
  workdir = os.path.join(_WORKDIR.value, f"{name}_seed{c.seed}")
  # The warm start's digest is part of what --reuse compares: a run kept or resumed from an
  # earlier invocation began from these weights, not only from this path.
  config = dict(config_record(c), init_digest=init["digest"])

  wall = _timed(workdir, lambda: colocated.train_and_evaluate(
      c, workdir, start_evaluation_from=evaluated_start(config, workdir)), config)
  steps = [r for r in metrics.read_metrics(workdir) if "time/step_s" in r]
  train = {}
  for key in ("main/overflow", "single/overflow", "sub/overflow", "main/delegations"):
    if any(key in r for r in steps):
      train[key] = float(np.mean([r[key] for r in steps if key in r]))
  commits = _run_commits(workdir)
  rec = dict(kind="rl", config=f"configs/mgrpo.py:{arg},init={init['workdir']}", variant=name,
             seed=c.seed, commit=commits[-1], commits=commits, init_digest=config["init_digest"],
             start_evaluation_from=play.copied_from(workdir, 0),
             steps=c.num_steps, wall_s=round(wall, 1),
             rollout_s=round(sum(r["time/rollout_s"] for r in steps), 1),
             update_s=round(sum(r["time/step_s"] - r["time/rollout_s"] for r in steps), 1),
             workdir=workdir, evals=_evals(workdir), train_means=train,
             questions=_final_questions(c, workdir))
  logging.info("RL %s: %.0f s, accuracy %s.", arg, wall,
               [round(e["accuracy"], 3) for e in rec["evals"]])
  return rec


@dataclasses.dataclass(frozen=True)
class _Disabled:
  """A tool that answers every call with an error: closed-book evaluation."""

  name: str

  def __call__(self, argument: str) -> str:
    del argument
    return f"Error: {self.name} is disabled (closed book)."


def question_log(c, *, closed_book: bool = False, env=None, questions=None) -> dict:
  """Greedy episodes of `c`'s agents (`c.init`'s weights) on the eval questions: correctness
  per question and per sub-agent call (for question-level tests beside the per-seed ones).
  `closed_book`: every tool answers with an error, so nothing can be read. `env` and
  `questions`: another task's (default: `c`'s task and its evaluation questions)."""
  w = setup.resolve_wiring(c, training=False)
  env = tasks.build_env(c) if env is None else env
  if closed_book:
    env = dataclasses.replace(env, tools={name: _Disabled(name) for name in env.tools})
  mesh = sharding.make_mesh(dict(c.mesh))
  agents = setup.build_agents(c, w, env, mesh, jax.random.key(c.seed))
  questions = tasks.eval_questions(c, env) if questions is None else questions
  policies = play.make_policies(c, w, env, agents, c.eval_sampling, version=0)
  eps, sub_eps = play.run_rollouts(c, w, env, policies, questions, num_rollouts=1,
                                   key=keys.eval_key(c, 0), step=0)
  outcome = hierarchy.main_outcomes(eps, [q.answers for q in questions], len(questions), 1,
                                    alpha=tuple(c.alpha))
  return play.question_record(questions, outcome.correct[:, 0], sub_eps)


def closed_book_run(init: dict, earlier: Sequence[dict] = ()) -> dict:
  """The main + sub warm start with tools disabled: the sub-agent's search and visit (and the
  python tool) answer with an error, so the pair answers from what its weights hold.

  With --reuse, the record an earlier invocation made (`earlier`: its runs) of the same warm
  start (digest), config and commit is kept (any commit with --reuse_any_commit): a greedy
  evaluation of the same weights answers the same, and it took about 3 minutes of every
  invocation that ran M-GRPO or frozen_sub.
  """
  arg = f"task=multihop,{_FLAG[_SIZE.value]},variant=mgrpo,init={init['workdir']}"
  config = f"configs/mgrpo.py:{arg}, every tool disabled"
  commit = git_commit()
  for r in earlier if _REUSE.value else ():
    if (r["kind"] == "closed_book" and r.get("init_digest") == init["digest"]
        and r.get("config") == config
        and (_REUSE_ANY_COMMIT.value or r.get("commit") == commit)):
      logging.info("Closed book: kept from an earlier invocation (%s).",
                   r.get("commit", "commit not recorded"))
      return r
  t0 = time.perf_counter()
  c = mgrpo_config.get_config(arg)
  c.eval_split = _EVAL_SPLIT.value
  log = question_log(c, closed_book=True)
  return dict(kind="closed_book", variant="closed_book", config=config,
              init_digest=init["digest"], commit=commit,
              wall_s=round(time.perf_counter() - t0, 1),
              evals=[{"step": 0, "accuracy": log["accuracy"]}], questions=log)


def _final_questions(c, workdir: str) -> dict:
  """The per-question record of a finished run's final evaluation (`play.questions_path`);
  a run from before the programs wrote one gets question_log of its final weights (its HF
  export), kept beside the run."""
  path = play.questions_path(workdir, c.num_steps)
  if os.path.exists(path):
    with open(path) as f:
      return json.load(f)
  path = os.path.join(workdir, "questions.json")
  if not os.path.exists(path):
    final = c.copy_and_resolve_references()
    final.init = workdir
    with open(path, "w") as f:
      json.dump(question_log(final), f)
  with open(path) as f:
    return json.load(f)


def summarize(records: list[dict], first_page: dict | None = None) -> dict:
  """Per variant: mean and 95% t-interval over seeds of every eval metric, by step and final.
  `first_page` (question id -> page, `hi.first_pages`): the question-level view also by page."""
  out = {}
  for variant in dict.fromkeys(r["variant"] for r in records if r["kind"] == "rl"):
    # By seed, whichever finished first: every per-seed list below is in this order.
    runs = sorted((r for r in records if r["kind"] == "rl" and r["variant"] == variant),
                  key=lambda r: r["seed"])
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
        s["mgrpo_minus"] = _difference_intervals(_minus(out["mgrpo"], s))
        s["mgrpo_vs_by_question"] = question_tests(records, "mgrpo", variant, first_page)
  # A control against the variant it controls for, the same way round (control minus it).
  for control, base in CONTROLS.items():
    if control in out and base in out:
      out[control][f"minus_{base}"] = _difference_intervals(_minus(out[control], out[base]))
      out[control][f"vs_{base}_by_question"] = question_tests(records, control, base,
                                                              first_page)
  return out


def question_tests(records: list[dict], a: str, b: str,
                   first_page: dict | None = None) -> list[dict]:
  """The question-level view, seed by seed: of the test questions on which variants `a` and
  `b` (same seed, final weights) disagree, how many only `a` answers right (a_only) and only
  `b` (b_only), and McNemar's exact two-sided p (binomial on the discordant questions); with
  `first_page`, the same by the page a question's chain opens on (`hi.sign_test_by_page`)."""
  logs = {(r["variant"], r["seed"]): r["questions"] for r in records
          if r["kind"] == "rl" and "questions" in r}
  out = []
  for seed in sorted({s for v, s in logs if v == a} & {s for v, s in logs if v == b}):
    out.append(dict(seed=seed, **hi.mcnemar_records(logs[(a, seed)], logs[(b, seed)],
                                                    f"seed {seed}: {a} and {b}", first_page)))
  return out


def _accuracy_keys(curves: dict) -> list[str]:
  return [k for k in curves if k == "accuracy" or k.startswith("accuracy_hops")]


def _minus(one: dict, other: dict) -> dict[str, list[float]]:
  """`one`'s final accuracy minus `other`'s (two variants' summaries), per key, over the seeds
  both ran."""
  out = {}
  for key in _accuracy_keys(other["curves"]):
    if key in one["curves"]:
      mine, theirs = ({seed: s[-1] for seed, s in zip(v["seeds"], v["curves"][key]["seeds"])}
                      for v in (one, other))
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


# The variants the table compares (issue 32's "done when": M-GRPO against frozen_sub and
# against the single agent, paired by seed).
COMPARED = ("mgrpo", "frozen_sub", "single")


def verdict(summary: dict, records: list[dict], margin: float = EFFECT,
            seeds_needed: int | None = None) -> dict:
  """Whether the table may rank the variants: only when M-GRPO's final accuracy beats the best
  baseline that reads nothing (the no-tool guesser, the closed-book warm start) by `margin`.

  `seeds_needed` (the power analysis's): until every variant in COMPARED has run that many
  seeds the verdict is `provisional`, a statement about the seeds so far.
  """
  base = {r["kind"]: r["evals"][-1]["accuracy"] for r in records
          if r["kind"] in ("no_tool", "closed_book") and r["evals"][-1].get("accuracy") is not None}
  if "mgrpo" not in summary or not base:
    return dict(informative=None, reason="M-GRPO or the no-reading baselines have not run yet")
  best = max(base, key=base.get)
  lead = summary["mgrpo"]["final"]["accuracy"]["mean"] - base[best]
  ok = lead >= margin
  seeds = {v: len(summary.get(v, {}).get("seeds", [])) for v in COMPARED}
  provisional = seeds_needed is not None and min(seeds.values()) < seeds_needed
  so_far = (f" (provisional: seeds so far {', '.join(f'{v} {n}' for v, n in seeds.items())} "
            f"of {seeds_needed})") if provisional else ""
  return dict(informative=ok, provisional=provisional, seeds=seeds, seeds_needed=seeds_needed,
              baselines=base, best_baseline=best, mgrpo_lead=round(lead, 4), margin=margin,
              reason=(f"M-GRPO leads {best} by {lead:+.3f}" + (
                  "" if ok else f" < {margin}: the instrument is uninformative; the table does "
                  "not rank the variants") + so_far))


def _key(r: dict) -> str:
  return f"{r['kind']}/{r['variant']}/{r.get('seed', '')}"


def _family(r: dict) -> str | None:
  """The warm start a run started from (its WARM_START name); None for what reads none."""
  if r["kind"] == "closed_book":
    return "mgrpo"
  return WARM_START.get(r["variant"]) if r["kind"] == "rl" else None


def split_by_warm_start(records: list[dict]) -> tuple[list[dict], list[dict]]:
  """(the records of the warm starts the JSON holds, the runs that started from another).

  A warm start made again (a new machine lost the old one before it was archived) is another
  draw of the same recipe: the runs from the old one are kept aside, not mixed into the
  summary with the new one's. A run without `init_digest` predates digests: it counts as from
  another warm start once its family's warm start has a digest."""
  digests = {r["variant"]: r.get("digest") for r in records if r["kind"] == "warm_start"}
  keep, other = [], []
  for r in records:
    family = _family(r)
    known = digests.get(family) if family else None
    (other if known and r.get("init_digest") != known else keep).append(r)
  return keep, other


def _earlier_runs(path: str) -> list[dict]:
  """The runs an earlier invocation wrote to `path` (none when there is no JSON yet)."""
  if not os.path.exists(path):
    return []
  with open(path) as f:
    return json.load(f).get("runs", [])


def check_split(path: str, split: str) -> None:
  """Raises ValueError when the sweep JSON at `path` holds invocations on another evaluation
  split: validation (tuning) runs never merge into the test table, nor the reverse."""
  if not os.path.exists(path):
    return
  with open(path) as f:
    _check_split(json.load(f), path, split)


def _check_split(old: dict, path: str, split: str) -> None:
  other = sorted({i.get("eval_split", "test") for i in old.get("invocations", [])} - {split})
  if other:
    raise ValueError(f"--out {path} holds runs evaluated on the {other[0]} split, this "
                     f"invocation evaluates on {split}: give it another --out (the default "
                     "for --eval_split=valid is hierarchy-heldout-valid-<size>.json).")


def _write(records: list[dict], path: str, wall_s: float, power: dict,
           first_page: dict | None = None, *, started: float | None = None) -> list[dict]:
  """Writes the sweep's JSON, merged with the runs and invocations an earlier invocation wrote
  to `path` (a sweep split over sessions: --seed_start / --only with --reuse); returns the
  merged records the summary is made from. `first_page`: as `summarize`'s.

  `started` (time.time() when this invocation began; default: now - `wall_s`) names this
  invocation's entry in `invocations` with its command and process id: a later write of
  the same invocation replaces it, and two invocations started in the same second beside
  each other are both kept."""
  old = {}
  if os.path.exists(path):
    with open(path) as f:
      old = json.load(f)
  _check_split(old, path, _EVAL_SPLIT.value)
  # Runs of a JSON from before this protocol (no invocations recorded) are not merged.
  merged = {_key(r): r for r in old.get("runs", [])} if "invocations" in old else {}
  # A warm start made again, and a record (closed_book) of the new one, replace the old ones'
  # records, which are kept aside.
  made_from = lambda r: r.get("digest") if r["kind"] == "warm_start" else r.get("init_digest")
  replaced = [merged[_key(r)] for r in records if _key(r) in merged
              and (r["kind"] == "warm_start" or _family(r))
              and made_from(merged[_key(r)]) != made_from(r)]
  merged.update({_key(r): r for r in records})
  records, aside = split_by_warm_start(list(merged.values()))
  aside = old.get("other_warm_start_runs", []) + replaced + aside
  invocation = dict(
      command=" ".join(["python", "benchmarks/hierarchy_sweep.py"] + sys.argv[1:]),
      commit=git_commit(), wall_s=round(wall_s, 1), eval_split=_EVAL_SPLIT.value,
      started=time.strftime("%Y-%m-%dT%H:%M:%SZ",
                            time.gmtime(time.time() - wall_s if started is None else started)),
      pid=os.getpid(),
      machine=dict(cpus=os.cpu_count(), platform=platform.platform(), jax=jax.__version__,
                   devices=str(jax.devices()),
                   loadavg_at_end=[round(x, 2) for x in os.getloadavg()]))
  ident = lambda i: (i.get("started"), i.get("command"), i.get("pid"))
  invocations = [i for i in old.get("invocations", [])
                 if ident(i) != ident(invocation)] + [invocation]
  summary = summarize(records, first_page)
  covered = {v: s["seeds"] for v, s in summary.items()}
  split = _EVAL_SPLIT.value
  split_flag = "" if split == "test" else f" --eval_split={split}"
  out = dict(
      command=f"python benchmarks/hierarchy_sweep.py --size={_SIZE.value} --seeds="
              f"{power['seeds']}{split_flag} --reuse, as {len(invocations)} invocation(s) "
              f"(listed in invocations); seeds run so far per variant: {covered}",
      # The sweep as a whole: every warm start's and run's own wall time (each counted once;
      # not those of other_warm_start_runs).
      runs_wall_s=round(sum(r.get("wall_s", 0) for r in records), 1),
      invocations=invocations, power_analysis=power,
      note=("Greedy accuracy on the test split (world.holdout: whole chains of held-out "
            "entities, used for nothing else)" if split == "test" else
            "Greedy accuracy on the validation split (world.holdout; for tuning choices, not "
            "for the table)") + "; intervals are mean +- t_{0.975, n-1} * sd / "
            "sqrt(n) over seeds. Wall times include compilation and evaluation, but for a "
            "run's step-0 evaluation when it copied that (start_evaluation_from: about 4 "
            "minutes less) and for a closed-book record kept from an earlier invocation "
            "(its wall_s is that invocation's).",
      verdict=verdict(summary, records, seeds_needed=power["seeds"]), summary=summary,
      runs=records,
      other_warm_start_runs=aside)
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  with open(path, "w") as f:
    json.dump(out, f, indent=1)
  return records


def _table(summary: dict) -> str:
  lines = []
  for variant, s in summary.items():
    f = s["final"]
    cell = lambda k: (f"{f[k]['mean']:.3f}" + (f" +- {f[k]['ci95']:.3f}" if f[k]["ci95"]
                                                is not None else "")) if k in f else "-"
    hops = "  ".join(f"h{k[-1]} {cell(k)}" for k in sorted(f) if k.startswith("accuracy_hops"))
    lines.append(f"{variant:10s} step {s['steps'][-1]}: accuracy {cell('accuracy')}  {hops}  "
                 f"overflow {cell('overflow')}  delegations {cell('delegations')}")
    for name in ("gain", "mgrpo_minus", *(f"minus_{b}" for b in CONTROLS.values())):
      if "accuracy" in s.get(name, {}):
        d = s[name]["accuracy"]
        half = f" +- {d['ci95']:.3f}" if d["ci95"] is not None else ""
        lines.append(f"{'':10s} {name}: {d['mean']:+.3f}{half} (per seed {d['seeds']})")
  return "\n".join(lines)


def main(argv):
  del argv
  logging.set_verbosity(logging.INFO)
  # As the launchers: a run compiles only the step shapes no earlier run of the sweep did
  # (the runs' wall times then depend on what the cache holds; --compilation_cache_dir=none
  # measures from an empty one).
  compile_cache.enable_from_flags()
  git_commit()  # Pinned now: the commit of the code this process runs.
  # A smoke run proves the pipeline, it measures nothing: its JSON stays in the workdir.
  results = _WORKDIR.value if _SIZE.value == "smoke" else "benchmarks/results"
  if _INSTRUMENT.value:
    path = _OUT.value or os.path.join(results, f"hierarchy-instrument-{_SIZE.value}.json")
    out = hi.instrument(path, _SIZE.value, _WORKDIR.value, timing=_TIMING.value,
                        command=" ".join(["python", "benchmarks/hierarchy_sweep.py"]
                                         + sys.argv[1:]))
    print(json.dumps({k: out[k] for k in ("splits", "power_analysis")}, indent=1))
    for r in out["baselines"]:
      print(f"{r['kind']:10s} {r['variant']:10s} accuracy {r['evals'][0]['accuracy']}")
    return
  # hierarchy-sweep-<size>.json is the first sweep's, on the task before issue 32.
  split = "" if _EVAL_SPLIT.value == "test" else f"{_EVAL_SPLIT.value}-"
  out = _OUT.value or os.path.join(results, f"hierarchy-heldout-{split}{_SIZE.value}.json")
  check_split(out, _EVAL_SPLIT.value)  # Before hours of runs, not after.
  out_png = _PLOT.value or os.path.splitext(out)[0] + ".png"
  probe = mgrpo_config.get_config(f"task=multihop,{_FLAG[_SIZE.value]}")
  probe.eval_split = _EVAL_SPLIT.value
  env = tasks.build_env(probe)
  num_test = min(probe.num_eval_questions, len(env.test))
  first_page = hi.first_pages(tasks.eval_questions(probe, env))
  power = power_analysis(num_test)
  seeds = _SEEDS.value or power["seeds"]
  args = [(mgrpo_config.get_config(a).variant, a) for a in mgrpo_config.hierarchy_sweep(
      _SIZE.value, seeds, seed_start=_SEED_START.value)]
  args += list(mgrpo_config.hierarchy_controls(_SIZE.value, seeds, seed_start=_SEED_START.value))
  if _ONLY.value:
    names = list(dict.fromkeys(name for name, _ in args))
    unknown = sorted(set(_ONLY.value) - set(names) - {"none"})
    if unknown:
      raise app.UsageError(f"--only: unknown {', '.join(map(repr, unknown))}; the sweep's "
                           f"variants and controls are {', '.join(names)} (or 'none')")
    args = [(name, a) for name, a in args if name in _ONLY.value]
  archive = _ARCHIVE.value
  if archive is None:  # The GPU size's warm starts are too large to commit.
    archive = "" if _SIZE.value == "gpu" else os.path.splitext(out)[0] + "-warm-starts"
  archive = "" if archive == "none" else archive
  t0, started = time.perf_counter(), time.time()
  records = hi.baselines(_SIZE.value, _EVAL_SPLIT.value, _WORKDIR.value)
  inits = {}
  for variant, arg in args:
    if WARM_START[variant] not in inits:
      rec = warm_start(WARM_START[variant], archive)
      records.append(rec)
      inits[WARM_START[variant]] = rec
      if WARM_START[variant] == "mgrpo":
        records.append(closed_book_run(rec, _earlier_runs(out)))
    records.append(rl_run(arg, inits[WARM_START[variant]], name=variant))
    _write(records, out, time.perf_counter() - t0, power, first_page, started=started)
  merged = _write(records, out, time.perf_counter() - t0, power, first_page, started=started)
  # Every invocation's runs, not only this one's: the curves are the sweep's so far.
  print(f"Sweep ({_SIZE.value}, seeds {_SEED_START.value}..{_SEED_START.value + seeds - 1}): "
        f"{time.perf_counter() - t0:.0f} s. {out}, {plot(merged, out_png)}")
  for r in records:
    if r["kind"] != "rl":
      print(f"{r['kind']:10s} {r['variant']:10s} accuracy "
            f"{[e.get('accuracy') for e in r['evals']]} ({r.get('wall_s', 0):.0f} s)")
  with open(out) as f:
    written = json.load(f)
  print(written["verdict"]["reason"])
  if written["verdict"]["informative"] is not False:
    print(_table(written["summary"]))


if __name__ == "__main__":
  app.run(main)
