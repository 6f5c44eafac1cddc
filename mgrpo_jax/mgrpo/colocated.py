"""Colocated M-GRPO: both roles in one process, the sub-agent called in-process.

  python launch/train.py --config=configs/mgrpo.py:runlocal --workdir=/tmp/mgrpo

Each step: rollouts (delegations served by a `ColocatedSubAgent` here), both sides of
`mgrpo.step` and the wiring's updates, driven by the one training loop; with
`config.max_staleness >= 1` the next steps' rollouts play while a step updates
(`pipeline.py`, docs/pipeline.md). The decoupled pair
(`decoupled.py`) computes exactly the same numbers over an exchange.
"""

import functools

import jax
import ml_collections

from mgrpo_jax import keys
from mgrpo_jax.mgrpo import play, setup, tasks
from mgrpo_jax.mgrpo import step as mgrpo_step


def train_and_evaluate(c: ml_collections.ConfigDict, workdir: str) -> dict:
  """Trains `c.variant` for `c.num_steps`, resuming from `workdir` if it holds a checkpoint."""
  rows = c.num_queries * c.num_rollouts
  p = setup.start(c, workdir, batch_rows={"num_queries*num_rollouts": rows,
                                          "num_queries*num_rollouts*align_d": rows * c.align_d})
  training_questions = tasks.TrainingQuestions(c, p.env)

  def rollout(step: int, weights: dict | None = None) -> play.Rollouts:
    """Step `step`'s rollouts by the agents' current weights, or by the published sampler
    `weights` of one policy version (`handoff.SamplerWeights`: the pipeline's)."""
    env, questions = training_questions(step)
    # An untrained agent's weights keep the version they were handed over at.
    version = step if weights is None else max(w.version for w in weights.values())
    policies = play.make_policies(c, p.wiring, env, p.agents if weights is None else weights,
                                  c.sampling, version=version)
    eps, sub_eps = play.run_rollouts(c, p.wiring, env, policies, questions,
                                     num_rollouts=c.num_rollouts, key=keys.step_key(c, step),
                                     step=step)
    return play.Rollouts(env, questions, eps, sub_eps)

  def learn(step: int, r: play.Rollouts) -> tuple[dict, dict]:
    return mgrpo_step.batches(c, p.wiring, r, jax.random.fold_in(keys.step_key(c, step), 2))

  def warm() -> None:  # `learn`'s programs, compiled while the first rollouts play.
    mgrpo_step.compile_host(c, p.wiring, jax.random.fold_in(keys.step_key(c, p.start), 2))

  def evaluate(step: int) -> dict:
    return play.evaluate(c, p.wiring, p.env, p.agents, step=step,
                         questions_file=play.questions_path(workdir, step))

  return p.run(workdir, rollout=rollout, learn=learn,
               train=functools.partial(mgrpo_step.update, p.wiring, p.agents),
               evaluate=evaluate, desc=c.variant,
               show=("main/reward", "single/reward", "eval/accuracy"),
               play=rollout, versions=play.behaviour_versions, warm=warm)

