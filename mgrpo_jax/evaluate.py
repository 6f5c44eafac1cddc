"""Held-out evaluation of a run's latest checkpoint, a config's models, or the experts."""

import json
import os

import jax
import ml_collections

from mgrpo_jax import checkpoint as ckpt_lib
from mgrpo_jax import sharding
from mgrpo_jax import train as train_lib


def run(c: ml_collections.ConfigDict, workdir: str) -> dict:
  """Evaluates and writes `workdir/eval.json` (accuracy, format rate, turns, delegations)."""
  os.makedirs(workdir, exist_ok=True)
  env = train_lib.build_env(c)
  agents, step = {}, 0
  if c.policy != "expert":
    mesh = sharding.make_mesh(dict(c.mesh))
    agents = train_lib.build_agents(c, env, mesh, jax.random.key(c.seed))
    ckpt = ckpt_lib.Checkpointer(os.path.join(workdir, "checkpoints"))
    step = train_lib.restore_agents(ckpt, agents)
    ckpt.close()
  metrics = train_lib.evaluate(c, env, agents, step=step)
  result = {"accuracy": metrics["eval/accuracy"], "step": step, "policy": c.policy,
            "variant": c.variant, "num_questions": min(c.num_eval_questions, len(env.test)),
            **{k.removeprefix("eval/"): v for k, v in metrics.items()}}
  with open(os.path.join(workdir, "eval.json"), "w") as f:
    json.dump(result, f, indent=2)
  return result
