"""The hierarchy ablation's runs: warm starts, RL runs and the closed-book record, each timed,
kept and resumed across invocations (`python -m experiments.hierarchy_ablation.sweep`).

Each run's done.json keeps its config and commit. With `reuse`, a finished run is kept only when
its config and commit are this invocation's (and what differs is named otherwise), and a run an
invocation left unfinished (progress.json) resumes from its checkpoints. A machine may be new:
finished warm starts are kept in an archive the user names (`archive.py`) and restored from
there; runs record the digest of the warm start they began from.
"""

import dataclasses
import json
import os
import shutil
import threading
import time
from typing import Sequence

import jax
import numpy as np
from absl import logging

from configs import mgrpo as mgrpo_config
from configs import sft as sft_config
from experiments.hierarchy_ablation import archive as archive_lib
from experiments.hierarchy_ablation import config as ablation
from experiments.hierarchy_ablation.instrument import git_commit
from mgrpo_jax import keys, metrics, sharding
from mgrpo_jax import workdir as workdir_lib
from mgrpo_jax.mgrpo import colocated, hierarchy, play, setup, sft, tasks


@dataclasses.dataclass(frozen=True)
class Options:
  """What an invocation runs on and keeps (the sweep's flags)."""

  size: str = "cpu"  # Task size: "cpu", "gpu" or "smoke".
  workdir: str = "/tmp/hierarchy_sweep"  # Runs go to subfolders.
  eval_split: str = "test"  # "test" for the table, "valid" for tuning and timing runs.
  reuse: bool = False  # Keep finished runs and resume unfinished ones (same config, commit).
  reuse_any_commit: bool = False  # With reuse: keep runs made at another commit too.


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


def _timed(workdir: str, run, config: dict, *, reuse: bool, any_commit: bool,
           heartbeat_s: float = 30.0,
           ignore: tuple = ()) -> float:
  """Runs `run()` in `workdir`, or reuses a finished run; its wall seconds.

  Without `reuse` a run starts from scratch. With it, a finished run (done.json) is kept, and
  an unfinished one (progress.json: an invocation stopped mid-run, e.g. at a session's end)
  goes on from its last checkpoint (`run` resumes from `workdir`); both only when their config
  and commit are this invocation's. A resumed run's wall seconds add what the earlier
  invocations spent on it, as of progress.json's last heartbeat (every `heartbeat_s`). Time
  while the process is stopped is not counted, beyond 4 heartbeats a pause (`_Clock`).
  """
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


def warm_start(opts: Options, variant: str, archive: str = "") -> dict:
  """The variant's warm start: made, or reused from the workdir or (with `opts.reuse`) from
  `archive`, where a finished one is then kept."""
  arg = f"task=multihop,{ablation.SIZE_FLAG[opts.size]},{ablation.EXTRA[variant]}"
  workdir = os.path.join(opts.workdir, f"sft-{variant}")
  c = sft_config.get_config(arg)
  # The warm start's own evaluations only monitor it (what RL adds is measured from each RL
  # run's first evaluation), so they read the validation split whatever --eval_split says:
  # one warm start then serves a validation (timing) invocation and the test invocations.
  c.eval_split = "valid"
  if archive and opts.reuse and archive_lib.restore(archive, workdir):
    logging.info("Warm start %s restored from %s.", variant, archive)
  wall = _timed(workdir, lambda: sft.train_sft(c, workdir), config_record(c),
                reuse=opts.reuse, any_commit=opts.reuse_any_commit, ignore=WARM_START_IGNORES)
  if archive and archive_lib.save(workdir, archive) is None:
    logging.warning("Warm start %s is over %d MiB: not archived; keep --workdir on a "
                    "persistent disk.", variant, archive_lib.MAX_BYTES // 2**20)
  commits = _run_commits(workdir)
  rec = dict(kind="warm_start", config=f"configs/sft.py:{arg}", variant=variant,
             commit=commits[-1], commits=commits, digest=archive_lib.digest(workdir),
             steps=c.sft.num_steps, wall_s=round(wall, 1), workdir=workdir,
             evals=_evals(workdir))
  logging.info("Warm start %s: %.0f s.", variant, wall)
  return rec


def rl_run(opts: Options, arg: str, init: dict, name: str = "") -> dict:
  """One RL run from the warm start `init` (its record); `name` labels a control (default:
  the config's variant). Each run evaluates its own step 0 (the warm start's weights)."""
  c = mgrpo_config.get_config(f"{arg},init={init['workdir']}")
  c.eval_split = opts.eval_split
  name = name or c.variant
  workdir = os.path.join(opts.workdir, f"{name}_seed{c.seed}")
  # The warm start's digest is part of what --reuse compares: a run kept or resumed from an
  # earlier invocation began from these weights, not only from this path.
  config = dict(config_record(c), init_digest=init["digest"])

  wall = _timed(workdir, lambda: colocated.train_and_evaluate(c, workdir), config,
                reuse=opts.reuse, any_commit=opts.reuse_any_commit)
  steps = [r for r in metrics.read_metrics(workdir) if "time/step_s" in r]
  train = {}
  for key in ("main/overflow", "single/overflow", "sub/overflow", "main/delegations"):
    if any(key in r for r in steps):
      train[key] = float(np.mean([r[key] for r in steps if key in r]))
  commits = _run_commits(workdir)
  rec = dict(kind="rl", config=f"configs/mgrpo.py:{arg},init={init['workdir']}", variant=name,
             seed=c.seed, commit=commits[-1], commits=commits, init_digest=config["init_digest"],
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


def closed_book_run(opts: Options, init: dict, earlier: Sequence[dict] = ()) -> dict:
  """The main + sub warm start with tools disabled: the sub-agent's search and visit (and the
  python tool) answer with an error, so the pair answers from what its weights hold.

  With `opts.reuse`, the record an earlier invocation made (`earlier`: its runs) of the same warm
  start (digest), config and commit is kept (any commit with `opts.reuse_any_commit`): a greedy
  evaluation of the same weights answers the same, and it took about 3 minutes of every
  invocation that ran M-GRPO or frozen_sub.
  """
  arg = f"task=multihop,{ablation.SIZE_FLAG[opts.size]},variant=mgrpo,init={init['workdir']}"
  config = f"configs/mgrpo.py:{arg}, every tool disabled"
  commit = git_commit()
  for r in earlier if opts.reuse else ():
    if (r["kind"] == "closed_book" and r.get("init_digest") == init["digest"]
        and r.get("config") == config
        and (opts.reuse_any_commit or r.get("commit") == commit)):
      logging.info("Closed book: kept from an earlier invocation (%s).",
                   r.get("commit", "commit not recorded"))
      return r
  t0 = time.perf_counter()
  c = mgrpo_config.get_config(arg)
  c.eval_split = opts.eval_split
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
