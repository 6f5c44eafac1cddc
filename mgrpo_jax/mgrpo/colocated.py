"""Colocated M-GRPO: both roles in one process, the sub-agent called in-process.

  python launch/train.py --config=configs/mgrpo.py:runlocal --workdir=/tmp/mgrpo

Each step: rollouts (delegations served by a `ColocatedSubAgent` here), the main side and
the sub side of `mgrpo.step`, and the wiring's updates, run by the one training loop.
The decoupled pair (`decoupled.py`) computes exactly the same numbers over an exchange.
"""

import os
import time

import jax
import ml_collections

from mgrpo_jax import checkpoint as ckpt_lib
from mgrpo_jax import config_checks as checks
from mgrpo_jax import keys, loop, sharding
from mgrpo_jax import workdir as workdir_lib
from mgrpo_jax.mgrpo import play, setup, tasks
from mgrpo_jax.mgrpo import step as mgrpo_step


def train_and_evaluate(c: ml_collections.ConfigDict, workdir: str) -> dict:
  """Trains `c.variant` for `c.num_steps`, resuming from `workdir` if it holds a checkpoint."""
  w = setup.resolve_wiring(c)
  os.makedirs(workdir, exist_ok=True)
  mesh = sharding.make_mesh(dict(c.mesh))
  rows = c.num_queries * c.num_rollouts
  checks.check_batch_divides_mesh(rows, mesh, "config.num_queries*num_rollouts")
  checks.check_batch_divides_mesh(rows * c.align_d, mesh,
                                  "config.num_queries*num_rollouts*align_d")
  env = tasks.build_env(c)
  setup.check_task(c, w, env)
  agents = setup.build_agents(c, w, env, mesh, jax.random.fold_in(jax.random.key(c.seed), 0))
  ckpt = ckpt_lib.Checkpointer(os.path.join(workdir, "checkpoints"), max_to_keep=c.max_to_keep)
  start = workdir_lib.restore_agents(ckpt, agents)
  if not start:
    workdir_lib.write_config(workdir, c)
  training_questions = tasks.TrainingQuestions(c, env)

  def update(step: int) -> dict:
    t0 = time.perf_counter()
    key = keys.step_key(c, step)
    step_env, questions = training_questions(step)
    policies = play.make_policies(c, w, step_env, agents, c.sampling, version=step)
    eps, sub_eps = play.run_rollouts(c, w, step_env, policies, questions,
                                     num_rollouts=c.num_rollouts, key=key, step=step)
    t_roll = time.perf_counter() - t0
    role_batches, m = mgrpo_step.batches(c, w, step_env, eps, sub_eps,
                                         jax.random.fold_in(key, 2))
    m.update(mgrpo_step.update(w, agents, role_batches, step))
    gen = sum(e.num_generated for e in eps) + sum(e.num_generated for e in sub_eps)
    m.update({"time/rollout_s": t_roll, "tokens_per_s": gen / t_roll})
    return m

  def evaluate(step: int) -> dict:
    return play.evaluate(c, w, env, agents, step=step,
                         questions_file=play.questions_path(workdir, step))

  schedule = loop.Schedule(c.num_steps, c.eval_every, c.checkpoint_every, c.log_every)
  return loop.train_loop(
      workdir, agents, ckpt, schedule, start=start, update=update, evaluate=evaluate,
      tokenizer=env.tokenizer, desc=c.variant,
      show=("main/reward", "single/reward", "eval/accuracy"))
