"""The main agent and the sub-agent as separate programs that share only an Exchange.

  python launch/main_agent.py --config=configs/mgrpo.py:smoke --workdir=/tmp/m \
      --exchange=file:///tmp/r1 &
  python launch/sub_agent.py --config=configs/mgrpo.py:smoke --workdir=/tmp/s \
      --exchange=file:///tmp/r1

What crosses, and why a restart is safe: `delegation.py`. Each program builds and restores
only its own agent, runs its column of `mgrpo.step` in the one training loop, and writes
its own metrics; the two files merged equal the colocated run's.

One URL (any kvstore URL or JSON spec) holds a whole decoupled run:

  <run>/exchange/...             the exchange's records and arrays (the main's attempt 0)
  <run>/exchange/attempt-<a>/... those of the main program's attempt a >= 1
                                 (max_staleness >= 1: `delegation.Attempts`)
  <run>/main/checkpoints/<step>  the main agent's orbax checkpoints
  <run>/sub/checkpoints/<step>   the sub-agent's
"""

import contextlib
import dataclasses
import functools

import jax
import numpy as np
from absl import logging

from mgrpo_jax import distributed, keys, lease
from mgrpo_jax.mgrpo import delegation, play, setup, tasks
from mgrpo_jax.mgrpo import step as mgrpo_step


def _lease(run, role: str):
  """The role's one-writer lease, held by process 0 (the others of a multi-host program
  write nothing to the run)."""
  if not distributed.is_primary():
    return contextlib.nullcontext()
  return lease.acquire_lease(delegation.open_exchange(run), role)


def _start(c, workdir: str, run, role: str) -> setup.Program:
  """This role's set-up: its own agent only, restored from the run location.

  Checkpoints go to the run location (`<run>/<role>/checkpoints`); where orbax cannot
  write there itself (s3://, see `checkpoint`), `<workdir>/checkpoints` is its cache.
  """
  return setup.start(c, workdir, only=role, checkpoints=delegation.checkpoint_location(run, role),
                     cache_dir=f"{workdir}/checkpoints")


def _run(p: setup.Program, workdir: str, role: str, **phases) -> None:
  # Pipelined: the learner compiles its host programs while the first step plays.
  warm = lambda: mgrpo_step.compile_host(p.c, p.wiring,
                                         jax.random.fold_in(keys.step_key(p.c, p.start), 2))
  p.run(workdir, train=functools.partial(mgrpo_step.update, p.wiring, p.agents),
        desc=f"{p.c.variant}:{role}", show=(f"{role}/reward", "eval/accuracy"),
        versions=play.behaviour_versions, warm=warm, **phases)


class _ReadBack:
  """The service of a step read back from the exchange: the waves its attempt sent."""

  def __init__(self, waves: int):
    self.waves = waves


def _shared(fn, *args):
  """`fn(*args)` on process 0, its value on every process (one attempt per program)."""
  value = fn(*args) if distributed.is_primary() else None
  return distributed.broadcast_object(value) if jax.process_count() > 1 else value


def _policies(c, p: setup.Program, env, step: int, weights) -> dict:
  """Step `step`'s turn policies: the agent's current weights, or the published sampler
  `weights` of one policy version (`max_staleness >= 1`: the pipeline's)."""
  version = step if weights is None else max(w.version for w in weights.values())
  return play.make_policies(c, p.wiring, env, p.agents if weights is None else weights,
                            c.sampling, version=version)


def run_main_agent(c, workdir: str, run, *, timeout_s: float = 600.0) -> None:
  """The main agent's program: rollouts that delegate over the exchange, then its update.

  `run` is the run location shared with the sub-agent (kvstore URL, JSON spec or path);
  `workdir` is this program's own directory (metrics, logs, final HF weights). With
  `config.max_staleness = k >= 1` the rollouts of the next k steps play while a step
  updates (`pipeline.py`), and so do the sub-agent program's; each start of the program is
  an attempt (`delegation.Attempts`): a restart reads back the steps whose outcome was
  published and plays the others in a namespace of its own.
  """
  # One writer per role: a second "main" program on this run stops here, naming the
  # live one, before it writes anything (its checkpoints included).
  with _lease(run, "main"):
    p = _start(c, workdir, run, "main")
    ex = delegation.open_exchange(run)
    training_questions = tasks.TrainingQuestions(c, p.env)
    attempts, first = None, p.start
    if c.max_staleness >= 1:
      attempts = delegation.Attempts(run)
      first = _shared(attempts.published, p.start, c.num_steps)
      attempt = _shared(attempts.begin, first)
      logging.info("main: attempt %d plays from step %d (%d steps read back).", attempt, first,
                   first - p.start)

    def ex_of(step: int, evaluation: bool = False):
      """The exchange of the attempt that owns `step` (one exchange with k = 0)."""
      return ex if attempts is None else attempts.exchange(
          attempts.owner(step, evaluation=evaluation))

    def rollout(step: int, weights: dict | None = None) -> play.Rollouts:
      env, questions = training_questions(step)
      if step < first:  # Its outcome is published: the sub-agent may have trained on it.
        exs = ex_of(step)
        eps = delegation.read_main_episodes(exs, step, questions, c.num_rollouts,
                                            c.limits.max_turns)
        waves = exs.wait_mark("rollouts_done", step, timeout_s=0)["waves"]
        return play.Rollouts(env, questions, eps, [], service=_ReadBack(waves))
      policies = _policies(c, p, env, step, weights)
      svc = delegation.ExchangeSubAgent(ex_of(step), step=step, timeout_s=timeout_s,
                                        version=step, max_staleness=c.max_staleness)
      eps, _ = play.run_rollouts(c, p.wiring, env, policies, questions,
                                 num_rollouts=c.num_rollouts, key=keys.step_key(c, step),
                                 step=step, service=svc)
      svc.close()  # No request of this step will come: the sub-agent's serving ends.
      return play.Rollouts(env, questions, eps, [], service=svc)

    def learn(step: int, r: play.Rollouts) -> tuple[dict, dict]:
      batch, outcome, m = mgrpo_step.main_side(c, p.wiring, r.env, r.questions, r.episodes)
      if attempts is not None and step >= first:  # Before the outcome: a restart reads them.
        delegation.put_main_episodes(ex_of(step), step, r.episodes)
      # R_M is all the sub-agent needs: published before this program's update runs.
      delegation.publish_outcome(ex_of(step), step, outcome, r.service.waves)
      return {"main": batch}, m

    def evaluate(step: int) -> dict:
      svc = delegation.ExchangeSubAgent(ex_of(step, evaluation=True),
                                        step=delegation.EVAL_STEP_BASE + step,
                                        timeout_s=timeout_s)
      m = play.evaluate(c, p.wiring, p.env, p.agents, step=step, service=svc,
                        questions_file=play.questions_path(workdir, step))
      svc.close()
      return m

    _run(p, workdir, "main", rollout=rollout, learn=learn, evaluate=evaluate, play=rollout)


def run_sub_agent(c, workdir: str, run, *, timeout_s: float = 600.0) -> None:
  """The sub-agent's program: serves each delegation of a step as it comes, then trains on
  its own episodes once the main agent's outcome of the step is published."""
  # One writer per role: a second "sub" program on this run stops here, naming the
  # live one, before it writes anything (its checkpoints included).
  with _lease(run, "sub"):
    p = _start(c, workdir, run, "sub")
    ex = delegation.open_exchange(run)
    # The main program's step questions come from this step's task: its tools serve them.
    training_questions = tasks.TrainingQuestions(c, p.env)
    rows = c.num_queries * c.num_rollouts  # Delegations in flight at most: one per episode.
    # With k >= 1 each step is served in the namespace of the main program's attempt that
    # owns it; a step a later attempt takes over is served and trained again.
    attempts = delegation.Attempts(run) if c.max_staleness >= 1 else None

    def owner(step: int, evaluation: bool = False):
      """(the exchange of `step`'s owning attempt, the check that it still owns it)."""
      if attempts is None:
        return ex, None
      a = attempts.owner(step, evaluation=evaluation)
      return attempts.exchange(a), functools.partial(attempts.check, step, a,
                                                     evaluation=evaluation)

    def rollout(step: int, weights: dict | None = None) -> play.Rollouts:
      env, questions = training_questions(step)
      policy = _policies(c, p, env, step, weights)["sub"]
      svc = play.colocated_sub_agent(c, env, policy, keys.step_key(c, step))
      exs, check = owner(step)
      # With k >= 1 a restart plays another version than the one that served: the
      # episodes behind results already written are kept on the exchange and read back.
      delegation.serve_step(exs, svc, step, timeout_s=timeout_s, read_outcome=False, rows=rows,
                            stored=c.max_staleness >= 1, check=check)
      return play.Rollouts(env, questions, [], svc.episodes, service=(exs, check))

    def learn(step: int, r: play.Rollouts) -> tuple[dict, dict]:
      # R_M as the main program published it (with k >= 1, while later steps are served),
      # in the attempt the step was served for.
      exs, check = r.service
      outcome = delegation.get_outcome(exs, step, timeout_s=timeout_s, check=check)
      batch, m = mgrpo_step.sub_side(c, p.wiring, r.env, r.questions, r.sub_episodes,
                                     outcome, jax.random.fold_in(keys.step_key(c, step), 2))
      return {"sub": batch}, m  # frozen_sub: `update` trains nothing on it.

    def evaluate(step: int) -> dict:
      policy = play.make_policies(c, p.wiring, p.env, p.agents, c.eval_sampling,
                                  version=step)["sub"]
      svc = play.colocated_sub_agent(c, p.env, policy, keys.eval_key(c, step))
      exs, check = owner(step, evaluation=True)
      delegation.serve_step(exs, svc, delegation.EVAL_STEP_BASE + step, timeout_s=timeout_s,
                            read_outcome=False, rows=len(tasks.eval_questions(c, p.env)),
                            check=check)
      eps = svc.episodes
      return {"eval/sub_format": float(np.mean([e.format_ok for e in eps])),
              "eval/sub_overflow": float(np.mean([play.overflowed(e) for e in eps]))
              } if eps else {}

    while True:
      try:
        return _run(p, workdir, "sub", rollout=rollout, learn=learn, evaluate=evaluate,
                    play=rollout)
      except delegation.MainRestarted as e:
        # Steps before e.step are trained (their records still count); the agent goes on
        # from its weights now, its metrics from the line of e.step.
        logging.warning("sub: %s Going on from step %d.", e, e.step)
        p = dataclasses.replace(p, start=e.step)
