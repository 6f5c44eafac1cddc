"""One MAGRPO step (algorithm.md 2): the joint rollout tree, joint rewards, per-agent batches.

Each agent is its own model with its own optimizer (float32 master weights) and jitted
update; rollouts, joint rewards, tree returns and advantages are shared. The objective is
the paper's REINFORCE form by default (`loss.kind="reinforce"`), the clipped surrogate as
an option; both come from `rl.train_step`, so nothing here differentiates anything.
"""

import dataclasses

import jax
import ml_collections
import numpy as np

from mgrpo_jax import config_checks as checks
from mgrpo_jax import keys, sharding, tokenizer_io, trainable
from mgrpo_jax import tokenizer as tk
from mgrpo_jax.magrpo import rollout, tasks
from mgrpo_jax.rl import batch as batch_lib
from mgrpo_jax.rl import joint

MIN_LENGTH = 32  # Shortest batch length: completions are short, so few shapes from 32 up.


def _fields() -> tuple[dict, dict]:
  """Every choice and numeric field of configs/magrpo.py, with what it may hold."""
  choices = {"joint_mode": joint.MODES, "adv_scale": ("std", "none"), "task.name": tasks.TASKS,
             "variant": ("magrpo", "single"), "pipeline": rollout.PIPELINES}
  model_choices, model_ranges = checks.model_fields("model")
  loss_choices, loss_ranges = checks.loss_fields("loss")
  optim_choices, optim_ranges = checks.optimizer_fields("optim")
  choices.update(model_choices, **loss_choices, **optim_choices)
  # G >= 2: a group of one sample has every advantage 0 and trains nothing.
  ranges = {"group": checks.at_least(2), "gamma": checks.PROBABILITY,
            "adv_eps": checks.POSITIVE, "max_to_keep": checks.at_least(1),
            "seed": checks.at_least(0), "num_steps": checks.at_least(0),
            "warm_start.num_steps": checks.at_least(0),
            "warm_start.batch_size": checks.at_least(1),
            "warm_start.learning_rate": checks.POSITIVE,
            "task.test_fraction": checks.Range(low=0, high=1, low_open=True, high_open=True),
            "task.num_agents": checks.at_least(1), "task.num_generated": checks.at_least(1),
            "task.workers": checks.at_least(1), "task.timeout_per_test_s": checks.POSITIVE}
  ranges.update(dict.fromkeys(("num_prompts", "num_turns", "eval_every", "num_eval",
                               "checkpoint_every", "max_new_tokens", "max_len", "num_micro",
                               "log_every"),
                              checks.at_least(1)))
  ranges.update(model_ranges, **loss_ranges, **optim_ranges,
                **checks.sampling_ranges("sampling", training=True),
                **checks.sampling_ranges("eval_sampling", training=False),
                **checks.mesh_ranges())
  return choices, ranges


def validate_config(c: ml_collections.ConfigDict) -> None:
  """Fails at start-up naming the field (see `checks.check_config`)."""
  checks.check_config(c, *_fields())
  checks.check_mesh(c)
  checks.check_weights(c, "turn_weights")
  error = checks.ConfigValueError
  if c.max_new_tokens >= c.max_len:
    raise error(f"config.max_new_tokens={c.max_new_tokens} leaves no room for a prompt in "
                f"config.max_len={c.max_len}; make it smaller.")
  if len(c.turn_weights) != c.num_turns:
    raise error(f"config.turn_weights={tuple(c.turn_weights)} needs one weight per turn "
                f"(config.num_turns={c.num_turns}).")
  if c.task.num_agents != 2 and c.task.name != "pick":
    raise error(f"config.task.num_agents={c.task.num_agents}: task {c.task.name!r} has two "
                "agents (only 'pick' takes N).")
  if c.pipeline == "sequential" and c.joint_mode != "align":
    raise error("config.pipeline='sequential' needs config.joint_mode='align'.")
  if c.loss.kl_coef:
    raise error(f"config.loss.kl_coef={c.loss.kl_coef}: MAGRPO has no reference policy (the "
                "paper uses no KL); set it to 0.")
  if c.task.name == "pick" and not 2 <= c.task.num_agents <= 4:
    raise error(f"config.task.num_agents={c.task.num_agents} must be in [2, 4] for 'pick' "
                "(one listed word per agent).")
  if c.task.name == "pick" and c.task.path:
    raise error(f"config.task.path={c.task.path!r}: the 'pick' task is generated and reads "
                "no file.")


@dataclasses.dataclass
class Run:
  """What a MAGRPO program holds: the task, tokenizer, mesh and one Agent per role."""

  task: tasks.Task
  tokenizer: tk.Tokenizer
  mesh: jax.sharding.Mesh
  agents: dict  # name -> trainable.Agent, in the task's agent order.


def build_agents(c, task, tokenizer, mesh, key, *, optim=None, loss=None) -> dict:
  """One Agent per role, each with its own weights (`init` or the model config)."""
  out, bases = {}, {}  # LoRA agents on one checkpoint share its frozen copy.
  for i, name in enumerate(task.agent_names):
    out[name] = trainable.build_agent(
        name, c.model, optim or c.optim, loss or c.loss, tokenizer, mesh,
        jax.random.fold_in(key, i), init_dir=c.init, num_micro=c.num_micro,
        temperature=c.sampling.temperature, bases=bases)
  return out


def setup(c) -> Run:
  """Checks the config; the task (one agent for `variant="single"`), tokenizer and agents."""
  validate_config(c)
  task = tasks.build_task(c.task, single=c.variant == "single")
  tokenizer = tokenizer_io.load_tokenizer(c.tokenizer)
  mesh = sharding.make_mesh(dict(c.mesh))
  # Agents from fold_in(root, 0); rollouts use step_key = fold_in(fold_in(root, 1), step).
  agents = build_agents(c, task, tokenizer, mesh, jax.random.fold_in(jax.random.key(c.seed), 0))
  return Run(task, tokenizer, mesh, agents)


def policies(c, run: Run, sampling_cfg) -> list[rollout.Policy]:
  return [rollout.Policy(a.model_config, a.params, run.tokenizer,
                         max_new_tokens=c.max_new_tokens, max_len=c.max_len,
                         temperature=sampling_cfg.temperature, top_p=sampling_cfg.top_p,
                         top_k=sampling_cfg.top_k, chunk=sampling_cfg.chunk,
                         kv_cache_budget_bytes=sampling_cfg.kv_cache_budget_bytes or None,
                         mesh=run.mesh, slots=sampling_cfg.get("slots", 0),
                         share_prompts=sampling_cfg.get("share_prompts", False))
          for a in run.agents.values()]


def _mean_metrics(prefix: str, metrics: list[dict]) -> dict:
  names = sorted({k for m in metrics for k in m})
  return {f"{prefix}/{k}": float(np.mean([m.get(k, 0.0) for m in metrics])) for k in names}


def turn_metrics(prefix: str, task, turns) -> dict:
  """Mean joint reward per turn, the last turn's task metrics and success rate."""
  m = {}
  for t, turn in enumerate(turns):
    m[f"{prefix}/reward_t{t}"] = float(turn.rewards_PxM.mean())
  last = turns[-1]
  m[f"{prefix}/reward"] = float(last.rewards_PxM.mean())
  m[f"{prefix}/return"] = m[f"{prefix}/reward"] / task.max_reward
  m.update(_mean_metrics(prefix, last.metrics))
  m[f"{prefix}/accuracy"] = m.get(f"{prefix}/{task.success}", 0.0)
  for i, name in enumerate(task.agent_names):
    m[f"{prefix}/{name}/gen_tokens"] = float(np.mean([len(x.generated)
                                                      for x in last.completions[i]]))
  return m


def evaluate(c, run: Run, *, step: int, examples=None) -> dict:
  """Held-out joint reward and success (greedy, one joint action per node)."""
  examples = run.task.test[:c.num_eval] if examples is None else examples
  turns = rollout.joint_rollout(run.task, policies(c, run, c.eval_sampling), examples, group=1,
                                mode="align", num_turns=c.num_turns, pipeline=c.pipeline,
                                key=keys.eval_key(c, step))
  return turn_metrics("eval", run.task, turns)


def make_batch(c, run: Run, rows: list, adv: np.ndarray) -> batch_lib.Batch:
  """A batch padded with masked rows so it splits over (data, fsdp) and micro-batches."""
  return batch_lib.make_batch(rows, adv, max_len=c.max_len, pad_id=run.tokenizer.pad_id,
                              minimum=MIN_LENGTH,
                              multiple=batch_lib.row_multiple(run.mesh, c.num_micro))


def batches(c, run: Run, turns) -> tuple[dict, dict]:
  """Per-agent batches from one step's tree: returns, joint and per-agent advantages."""
  index = joint.joint_indices(run.task.num_agents, c.group, c.joint_mode)
  weights = joint.member_weights(index, c.group)
  rets = joint.tree_returns([t.rewards_PxM for t in turns], num_joint=len(index), gamma=c.gamma)
  adv_joint = [joint.joint_advantages(r, num_joint=len(index), scale=c.adv_scale, eps=c.adv_eps)
               for r in rets]
  out = {}
  for i, name in enumerate(run.task.agent_names):
    adv_i = [np.asarray(joint.agent_advantages(a, weights[i])) for a in adv_joint]
    out[name] = make_batch(c, run, *rollout.turn_rows(turns, i, adv_i, c.turn_weights))
  m = {"train/return_t0": float(np.mean(rets[0])),
       "train/adv_abs": float(np.mean([np.abs(a).mean() for a in adv_joint]))}
  return out, m
