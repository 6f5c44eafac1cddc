"""The main agent and the sub-agent as separate programs that share only an Exchange.

  python launch/main_agent.py --config=configs/mgrpo.py:smoke --workdir=/tmp/m \
      --exchange=file:///tmp/r1 &
  python launch/sub_agent.py --config=configs/mgrpo.py:smoke --workdir=/tmp/s \
      --exchange=file:///tmp/r1

What crosses, and why a restart is safe: `delegation.py`. Each program builds and restores
only its own agent, runs its column of `mgrpo.step` in the one training loop, and writes
its own metrics; the two files merged equal the colocated run's.

One URL (any kvstore URL or JSON spec) holds a whole decoupled run:

  <run>/exchange/...            the exchange's records and arrays
  <run>/main/checkpoints/<step> the main agent's orbax checkpoints
  <run>/sub/checkpoints/<step>  the sub-agent's
"""

import contextlib

import jax
import numpy as np

from mgrpo_jax import checkpoint as ckpt_lib
from mgrpo_jax import config_checks as checks
from mgrpo_jax import distributed, keys, lease, loop, sharding
from mgrpo_jax import workdir as workdir_lib
from mgrpo_jax.mgrpo import delegation, play, setup, tasks
from mgrpo_jax.mgrpo import step as mgrpo_step


def _lease(run, role: str):
  """The role's one-writer lease, held by process 0 (the others of a multi-host program
  write nothing to the run)."""
  if not distributed.is_primary():
    return contextlib.nullcontext()
  return lease.acquire_lease(delegation.open_exchange(run), role)


def _setup(c, workdir: str, run, role: str):
  """This role's wiring, task, own agent (restored), checkpointer and first step.

  Checkpoints go to the run location (`<run>/<role>/checkpoints`); where orbax cannot
  write there itself (s3://, see `checkpoint`), `<workdir>/checkpoints` is its cache.
  """
  w = setup.resolve_wiring(c)
  if w.merge or not w.has_sub:
    raise checks.ConfigValueError(f"config.variant={c.variant!r} has no separate sub-agent; "
                                  "decoupled runs need 'mgrpo' or 'frozen_sub'.")
  mesh = sharding.make_mesh(dict(c.mesh))
  env = tasks.build_env(c)
  setup.check_task(c, w, env)
  agents = setup.build_agents(c, w, env, mesh, jax.random.fold_in(jax.random.key(c.seed), 0),
                              only=role)
  ckpt = ckpt_lib.Checkpointer(delegation.checkpoint_location(run, role),
                              cache_dir=f"{workdir}/checkpoints", max_to_keep=c.max_to_keep)
  start = workdir_lib.restore_agents(ckpt, agents)
  if not start:
    workdir_lib.write_config(workdir, c)
  return w, env, agents, ckpt, start


def _run(c, workdir, w, env, agents, ckpt, start, *, evaluate, update, role):
  schedule = loop.Schedule(c.num_steps, c.eval_every, c.checkpoint_every, c.log_every)
  loop.train_loop(workdir, agents, ckpt, schedule, start=start, evaluate=evaluate,
                  update=update, tokenizer=env.tokenizer, desc=f"{c.variant}:{role}",
                  show=(f"{role}/reward", "eval/accuracy"))


def run_main_agent(c, workdir: str, run, *, timeout_s: float = 600.0) -> None:
  """The main agent's program: rollouts that delegate over the exchange, then its update.

  `run` is the run location shared with the sub-agent (kvstore URL, JSON spec or path);
  `workdir` is this program's own directory (metrics, logs, final HF weights).
  """
  # One writer per role: a second "main" program on this run stops here, naming the
  # live one, before it writes anything (its checkpoints included).
  with _lease(run, "main"):
    w, env, agents, ckpt, start = _setup(c, workdir, run, "main")
    ex = delegation.open_exchange(run)
    training_questions = tasks.TrainingQuestions(c, env)

    def evaluate(step: int) -> dict:
      svc = delegation.ExchangeSubAgent(ex, step=delegation.EVAL_STEP_BASE + step,
                                        timeout_s=timeout_s)
      m = play.evaluate(c, w, env, agents, step=step, service=svc,
                        questions_file=play.questions_path(workdir, step))
      ex.mark("rollouts_done", delegation.EVAL_STEP_BASE + step, {"waves": svc.waves})
      return m

    def update(step: int) -> dict:
      step_env, questions = training_questions(step)
      policies = play.make_policies(c, w, step_env, agents, c.sampling, version=step)
      # Scripted experts (config.policy="expert") have no weight version to go stale.
      version = None if c.policy == "expert" else step
      svc = delegation.ExchangeSubAgent(ex, step=step, timeout_s=timeout_s, version=version,
                                        max_staleness=c.max_staleness)
      eps, _ = play.run_rollouts(c, w, step_env, policies, questions,
                                 num_rollouts=c.num_rollouts, key=keys.step_key(c, step),
                                 step=step, service=svc)
      batch, outcome, m = mgrpo_step.main_side(c, w, step_env, eps)
      delegation.publish_outcome(ex, step, outcome, svc.waves)
      m.update(mgrpo_step.update(w, agents, {"main": batch}, step))
      return m

    _run(c, workdir, w, env, agents, ckpt, start, evaluate=evaluate, update=update, role="main")


def run_sub_agent(c, workdir: str, run, *, timeout_s: float = 600.0) -> None:
  """The sub-agent's program: serves every wave of a step, then trains on its own episodes."""
  # One writer per role: a second "sub" program on this run stops here, naming the
  # live one, before it writes anything (its checkpoints included).
  with _lease(run, "sub"):
    w, env, agents, ckpt, start = _setup(c, workdir, run, "sub")
    ex = delegation.open_exchange(run)
    # The main program's step questions come from this step's task: its tools serve them.
    training_questions = tasks.TrainingQuestions(c, env)

    def evaluate(step: int) -> dict:
      policy = play.make_policies(c, w, env, agents, c.eval_sampling, version=step)["sub"]
      svc = play.colocated_sub_agent(c, env, policy, keys.eval_key(c, step))
      delegation.serve_step(ex, svc, delegation.EVAL_STEP_BASE + step, timeout_s=timeout_s,
                            read_outcome=False)
      eps = svc.episodes
      return {"eval/sub_format": float(np.mean([e.format_ok for e in eps])),
              "eval/sub_overflow": float(np.mean([play.overflowed(e) for e in eps]))
              } if eps else {}

    def update(step: int) -> dict:
      key = keys.step_key(c, step)
      step_env, questions = training_questions(step)
      policy = play.make_policies(c, w, step_env, agents, c.sampling, version=step)["sub"]
      svc = play.colocated_sub_agent(c, step_env, policy, key)
      outcome = delegation.serve_step(ex, svc, step, timeout_s=timeout_s)
      batch, m = mgrpo_step.sub_side(c, step_env, svc.episodes, outcome, jax.random.fold_in(key, 2),
                                     align=w.align, questions=questions)
      m.update(mgrpo_step.update(w, agents, {"sub": batch}, step))  # frozen_sub: no update.
      return m

    _run(c, workdir, w, env, agents, ckpt, start, evaluate=evaluate, update=update, role="sub")
