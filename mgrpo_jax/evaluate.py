"""Held-out evaluation of a run's latest checkpoint, a config's models, or the experts.

  python launch/evaluate.py --config=configs/mgrpo.py:runlocal,policy=expert --workdir=/tmp/e
"""

import json
import os

import jax
import ml_collections

from mgrpo_jax import checkpoint as ckpt_lib
from mgrpo_jax import config_checks as checks
from mgrpo_jax import distributed, sharding
from mgrpo_jax import workdir as workdir_lib
from mgrpo_jax.envs import tool_health
from mgrpo_jax.mgrpo import delegation, play, setup, tasks
from mgrpo_jax.magrpo import step as magrpo_step

# Beside eval.json: each question's correctness and each sub-agent call's (M-GRPO configs).
QUESTIONS_FILE = "eval_questions.json"


def _restore_pair(agents: dict, run, workdir: str) -> int:
  """Loads each role from `<run>/<role>/checkpoints` at the newest step all of them have."""
  ckpts = {role: ckpt_lib.Checkpointer(delegation.checkpoint_location(run, role),
                                       cache_dir=os.path.join(workdir, "checkpoints", role))
           for role in agents}
  try:
    found = {role: ck.all_steps() for role, ck in ckpts.items()}
    common = set.intersection(*(set(s) for s in found.values()))
    if not common:
      raise FileNotFoundError(f"No step committed by every role in run {run!r}: "
                              f"{ {r: s for r, s in found.items()} }.")
    step = max(common)
    for role, ck in ckpts.items():
      states, _ = ck.restore(step, abstract_states={role: agents[role].state})
      agents[role].state = states[role]
  finally:
    for ck in ckpts.values():
      ck.close()
  return step


def _restore_latest(workdir: str, agents: dict) -> int:
  with ckpt_lib.Checkpointer(os.path.join(workdir, "checkpoints")) as ckpt:
    return workdir_lib.restore_agents(ckpt, agents)


def _write(workdir: str, result: dict) -> dict:
  if not distributed.is_primary():  # Every process has the same result; one writes it.
    return result
  with open(os.path.join(workdir, "eval.json"), "w") as f:
    json.dump(result, f, indent=2)
  return result


def _run_magrpo(c: ml_collections.ConfigDict, workdir: str) -> dict:
  """MAGRPO: the latest checkpoint in `workdir` (else the config's weights)."""
  run = magrpo_step.setup(c)
  step = _restore_latest(workdir, run.agents)
  m = magrpo_step.evaluate(c, run, step=step)
  return _write(workdir, {
      "accuracy": m["eval/accuracy"], "step": step, "task": c.task.name, "variant": c.variant,
      "pipeline": c.pipeline, "num_examples": min(c.num_eval, len(run.task.test)),
      **{k.removeprefix("eval/"): v for k, v in m.items()}})


def run(c: ml_collections.ConfigDict, workdir: str, *, run_location=None) -> dict:
  """Evaluates and writes `workdir/eval.json` (accuracy, format rate, turns, delegations)
  and, for M-GRPO configs, `QUESTIONS_FILE` (each question's correctness).

  The weights: the latest checkpoint in `workdir/checkpoints` (a colocated run's), or
  with `run_location` the latest pair of a decoupled run (the newest step that both
  role programs have committed under it), or none for the experts. Both roles play
  in this process either way. MAGRPO configs (`program="magrpo"`) evaluate their agents
  on the task's held-out examples.
  """
  os.makedirs(workdir, exist_ok=True)
  if c.get("program") == "magrpo":
    if run_location:
      raise checks.ConfigValueError("--run is for decoupled M-GRPO runs; MAGRPO evaluates "
                                    "--workdir.")
    return _run_magrpo(c, workdir)
  w = setup.resolve_wiring(c, training=False)
  env = tasks.build_env(c)
  setup.check_task(c, w, env, training=False)
  agents, step = {}, 0
  if c.policy != "expert":
    mesh = sharding.make_mesh(dict(c.mesh))
    agents = setup.build_agents(c, w, env, mesh, jax.random.key(c.seed))
    if run_location is not None:
      step = _restore_pair(agents, run_location, workdir)
    else:
      step = _restore_latest(workdir, agents)
  elif run_location is not None:
    raise checks.ConfigValueError("config.policy='expert' evaluates the scripted experts; "
                                  "drop --run.")
  metrics = play.evaluate(c, w, env, agents, step=step,
                          questions_file=os.path.join(workdir, QUESTIONS_FILE))
  metrics.update(tool_health.step_metrics())
  result = {"accuracy": metrics["eval/accuracy"], "step": step, "policy": c.policy,
            "variant": c.variant, "num_questions": min(c.num_eval_questions, len(env.test)),
            **{k.removeprefix("eval/"): v for k, v in metrics.items()}}
  if run_location is not None:
    result["run"] = run_location if isinstance(run_location, str) else json.dumps(run_location)
  return _write(workdir, result)
