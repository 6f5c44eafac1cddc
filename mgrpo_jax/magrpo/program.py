"""The MAGRPO program: a supervised warm start, then MAGRPO steps in the one training loop.

  python launch/train.py --config=configs/magrpo.py:runlocal --workdir=/tmp/magrpo

The step (joint rollouts, joint rewards, per-agent batches) is `magrpo.step`; the warm start
trains on the task's demonstrations with the same NLL objective as `sft.py`
(`trainable.nll_objective`).
"""

import functools
import os
import time

import jax
import ml_collections
import numpy as np
from absl import logging

from mgrpo_jax import checkpoint as ckpt_lib
from mgrpo_jax import config_checks as checks
from mgrpo_jax import keys, loop, trainable
from mgrpo_jax.magrpo import rollout as rollout_lib
from mgrpo_jax.magrpo import step as step_lib
from mgrpo_jax.metrics import Progress


def _demonstrations(c, run: step_lib.Run, agent: int, rng: np.random.Generator) -> list:
  """A batch of (prompt, demonstration) rows for agent `agent`."""
  tok, rows = run.tokenizer, []
  for e in rng.choice(len(run.task.train), c.warm_start.batch_size):
    ex = run.task.train[e]
    prompt = tok.apply_chat_template([{"role": "user", "content": run.task.prompts(ex)[agent]}],
                                     add_generation_prompt=True)
    target = tok.encode(run.task.demonstration(ex, agent, rng)) + [tok.eos_id]
    rows.append(rollout_lib.Completion(prompt, target, [0.0] * len(target), "", "stop"))
  return rows


def warm_start(c, run: step_lib.Run) -> dict:
  """Supervised warm start on the task's demonstrations (NLL = REINFORCE with A = 1)."""
  ws = c.warm_start
  if run.task.demonstration is None:
    raise checks.ConfigValueError(f"config.warm_start.num_steps={ws.num_steps}, but task "
                                  f"{run.task.name!r} has no demonstrations.")
  lc, oc = trainable.nll_objective(c.loss, c.optim, learning_rate=ws.learning_rate,
                                   weight_decay=0.0)
  sft = step_lib.build_agents(c, run.task, run.tokenizer, run.mesh,
                              jax.random.fold_in(jax.random.key(c.seed), 0), optim=oc, loss=lc)
  logging.info("warm start: %d supervised steps on the task's demonstrations.", ws.num_steps)
  progress, m = Progress(ws.num_steps, desc="warm start", log_every=c.log_every), {}
  for step in range(ws.num_steps):
    batches = {}
    for i, name in enumerate(sft):
      rows = _demonstrations(c, run, i, np.random.default_rng([c.seed, step, i]))
      batches[name] = step_lib.make_batch(c, run, rows, np.ones(len(rows), np.float32))
    out = trainable.update_agents(sft, batches, step)
    m = {f"warm/{name}/nll": out[f"{name}/loss"] for name in sft}
    progress.update(1, m)
  progress.close()
  for name, agent in run.agents.items():
    agent.state = agent.state.replace(params=sft[name].state.params)  # Fresh RL optimizer.
  return m


def train_and_evaluate(c: ml_collections.ConfigDict, workdir: str) -> dict:
  """Trains the task's agents for `c.num_steps`; resumes from `workdir`'s checkpoint."""
  os.makedirs(workdir, exist_ok=True)
  run = step_lib.setup(c)
  ckpt = ckpt_lib.Checkpointer(os.path.join(workdir, "checkpoints"), max_to_keep=c.max_to_keep)
  fresh = ckpt.latest_step() is None
  start = loop.resume(ckpt, run.agents, workdir, c)
  first = {}
  if fresh and c.warm_start.num_steps:
    t0 = time.perf_counter()
    first = warm_start(c, run)
    first["time/warm_start_s"] = time.perf_counter() - t0
    # The warm start is step 0's state: a restart never repeats it, and its metrics go
    # with it, so step 0's record is rewritten whole.
    ckpt.save(0, {n: a.state for n, a in run.agents.items()}, {"step": 0, "warm": first},
              force=True)
  elif not fresh and start == 0:
    first = dict(ckpt.restore(0, abstract_states={n: a.state for n, a in run.agents.items()})[1]
                 .get("warm", {}))

  def rollout(step: int) -> list:
    examples = keys.examples_for_step(run.task.train, step, c.num_prompts, c.seed)
    return rollout_lib.joint_rollout(run.task, step_lib.policies(c, run, c.sampling), examples,
                                     group=c.group, mode=c.joint_mode, num_turns=c.num_turns,
                                     key=keys.step_key(c, step), pipeline=c.pipeline)

  def learn(step: int, turns: list) -> tuple[dict, dict]:
    m = step_lib.turn_metrics("train", run.task, turns)
    batches, bm = step_lib.batches(c, run, turns)
    m.update(bm)
    return batches, m

  update = loop.step_driver(rollout=rollout, learn=learn,
                            train=functools.partial(trainable.update_agents, run.agents))
  return loop.train_loop(workdir, run.agents, ckpt, loop.Schedule.of(c), start=start,
                         update=update, evaluate=lambda step: step_lib.evaluate(c, run, step=step),
                         tokenizer=run.tokenizer, desc=f"magrpo:{c.task.name}",
                         show=("train/reward", "eval/accuracy"), first=first)
