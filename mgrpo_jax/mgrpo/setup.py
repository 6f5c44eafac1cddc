"""M-GRPO's setup: the variant as wiring, the config and task checks, the agents, and the
set-up every program does once (`start`).

The variant (`config.variant`) is resolved once, by `resolve_wiring`, into a frozen `Wiring`
that the step and the programs take; nothing else reads it:
  mgrpo       main and sub-agent, separate weights, both trained (docs/algorithm.md)
  frozen_sub  the same rollouts, but the sub-agent's update is never run
  shared      one set of weights plays both roles; one update on both roles' rows
  single      one agent with every tool (single-agent GRPO), no sub-agent
  unaligned   mgrpo without trajectory alignment: every sub-agent episode once
The wiring also carries what the step would otherwise look up each time: the alignment
(D, drawn or padded, what an empty rollout gives) and the sub-agent's judge.
"""

import dataclasses
import functools
import importlib
import os
from typing import Callable, Mapping

import jax
import ml_collections

from mgrpo_jax import checkpoint as ckpt_lib
from mgrpo_jax import config_checks as checks
from mgrpo_jax import handoff, loop, pipeline, sharding, trainable
from mgrpo_jax.agents import native
from mgrpo_jax.rl import rewards
from mgrpo_jax.config_checks import ConfigValueError
from mgrpo_jax.mgrpo import hierarchy, tasks
from mgrpo_jax.mgrpo.tasks import Env


@dataclasses.dataclass(frozen=True)
class Wiring:
  """A variant as wiring: who plays which role, who trains, whether batches merge."""

  roles: tuple[str, ...]  # The rollout's roles; the first answers the question.
  agent_of: Mapping[str, str]  # Role -> the agent whose weights play it.
  trained: tuple[str, ...]  # Agents whose update runs.
  merge: bool  # One update on both roles' rows (one agent plays both).
  # Sub-agent rows: "sample" (trajectory alignment, algorithm.md 1.4: D per rollout, drawn) or
  # "pad" (each rollout's calls once, none duplicated or dropped; padding rows masked). The
  # variant names the mode; `resolve_wiring` fills in D and `on_empty` from the config.
  align: hierarchy.Alignment = hierarchy.Alignment()
  # r_expert(S) of a sub-agent episode, the judge loaded once (`expert_scorer`): None while
  # beta3 = 0, and in the table (`resolve_wiring` sets it).
  expert_score: Callable | None = None

  @property
  def lead(self) -> str:
    return self.roles[0]

  @property
  def has_sub(self) -> bool:
    return "sub" in self.roles

  @property
  def agents(self) -> tuple[str, ...]:
    return tuple(dict.fromkeys(self.agent_of.values()))


_PAIR = {"main": "main", "sub": "sub"}
WIRINGS = {
    "mgrpo": Wiring(("main", "sub"), _PAIR, trained=("main", "sub"), merge=False),
    "frozen_sub": Wiring(("main", "sub"), _PAIR, trained=("main",), merge=False),
    "shared": Wiring(("main", "sub"), {"main": "main", "sub": "main"}, trained=("main",),
                     merge=True),
    "single": Wiring(("single",), {"single": "single"}, trained=("single",), merge=False),
    "unaligned": Wiring(("main", "sub"), _PAIR, trained=("main", "sub"), merge=False,
                        align=hierarchy.Alignment(mode="pad")),
}


def _fields(training: bool) -> tuple[dict, dict]:
  """Every choice and numeric field of configs/mgrpo.py, with what it may hold."""
  choices = {"variant": tuple(WIRINGS), "policy": ("model", "expert"),
             "adv_scale": ("std", "none"), "align_on_empty": ("mask", "borrow")}
  # A group of one rollout has every advantage 0: training needs K >= 2 (evaluation: any).
  ranges = {"num_rollouts": checks.at_least(2 if training else 1),
            "adv_eps": checks.POSITIVE, "max_to_keep": checks.at_least(1),
            "max_staleness": checks.at_least(0), "seed": checks.at_least(0),
            "rollout_devices": checks.at_least(0),
            "expert_noise": checks.PROBABILITY}
  ranges.update(dict.fromkeys(("num_queries", "align_d", "num_steps", "eval_every",
                               "num_eval_questions", "checkpoint_every", "num_micro",
                               "log_every"), checks.at_least(1)))
  for role in ("main", "sub"):
    for section in (checks.model_fields(f"{role}_model"), checks.loss_fields(f"{role}_loss"),
                    checks.optimizer_fields(f"{role}_optim")):
      choices.update(section[0])
      ranges.update(section[1])
  choices.update(checks.retrieval_fields()[0])
  ranges.update(checks.retrieval_fields()[1])
  ranges.update(checks.limits_ranges(), **checks.world_ranges(), **checks.mesh_ranges(),
                **checks.sampling_ranges("sampling", training=training),
                **checks.sampling_ranges("eval_sampling", training=False))
  return choices, ranges


# Agent -> (its config sections' prefix, its key index under the agents' key).
_SECTIONS = {"main": ("main", 0), "single": ("main", 0), "sub": ("sub", 1)}


def resolve_wiring(c: ml_collections.ConfigDict, *, training: bool = True) -> Wiring:
  """Checks the config (naming a bad field) and resolves its variant into wiring.

  `training=False` (evaluation) allows a single rollout and greedy sampling.
  """
  checks.check_config(c, *_fields(training))
  checks.check_weights(c, "alpha", 2)
  checks.check_weights(c, "beta", 3)
  # Loaded here, once: a judge that cannot be loaded fails at start-up, not at an update.
  expert_score = expert_scorer(c)
  checks.check_weights(c, "world.hop_weights")
  tasks.check_rl_worlds(c)
  checks.check_world(c)
  checks.check_mesh(c)
  checks.check_turn_fits(c)
  if c.retrieval.backend == "http" and not c.retrieval.url:
    raise ConfigValueError("config.retrieval.backend='http' needs config.retrieval.url "
                                    "(e.g. http://127.0.0.1:8000/retrieve).")
  w = WIRINGS[c.variant]
  rows = c.num_queries * c.num_rollouts
  if not w.has_sub and c.num_micro and rows % c.num_micro:
    raise ConfigValueError(f"config.num_micro={c.num_micro} does not divide the batch "
                                    f"of num_queries*num_rollouts={rows}.")
  # "pad" keeps every call: D is the most a rollout can make, no rollout has more.
  d = c.limits.max_delegations if w.align.mode == "pad" else c.align_d
  align = dataclasses.replace(w.align, d=d, on_empty=c.align_on_empty)
  return dataclasses.replace(w, align=align, expert_score=expert_score)


def check_task(c: ml_collections.ConfigDict, w: Wiring, env: Env, *,
               training: bool = True) -> None:
  """What the config asks of the built task: questions to train on, prompts that fit.

  The lead role's longest first prompt plus one turn must fit `limits.max_len`; a
  sub-agent's prompt is its template plus a subtask of at most one main turn. Task=qa
  needs `data.train` to train and `data.eval` to evaluate (`training=False`).
  """
  if "data" in c and not (env.train if training else env.test):
    field = "train" if training else "eval"
    raise ConfigValueError(f"task=qa: config.data.{field} names no questions to "
                           f"{'train on' if training else 'evaluate'}.")
  if "data" not in c and not env.train:
    raise ConfigValueError(
        f"config.world.num_questions={c.world.num_questions} with "
        f"config.world.test_fraction={c.world.test_fraction} leaves no training question.")
  lim, skip = c.limits, 0 if c.world.system_prompt else 1
  # The native protocol's prompts hold the tools' schemas too (agents/native.py).
  dialect = native.Dialect(c.get("protocol", "tags"))
  lead = "single" if w.lead == "single" else "main"
  prompt = lambda m, role: len(dialect.prompt_ids(env.tokenizer, m[skip:], role))
  longest = max(prompt(dialect.messages(lead, q.text), lead) for q in env.train + env.test)
  checks.check_prompt_fits(longest, f"the longest {w.lead} prompt",
                           max_len=lim.max_len, max_new_tokens=lim.max_new_tokens)
  if w.has_sub:
    checks.check_prompt_fits(prompt(dialect.messages("sub", ""), "sub") + lim.max_new_tokens,
                             "a sub-agent prompt with a subtask of one main turn",
                             max_len=lim.max_len, max_new_tokens=lim.max_new_tokens)


def build_agents(c, w: Wiring, env: Env, mesh, key, *, only: str | None = None) -> dict:
  """The wiring's agents (or only agent `only`: a decoupled program owns just its own)."""
  out, bases = {}, {}  # LoRA agents on one checkpoint share its frozen copy.
  for name in w.agents:
    if only is None or name == only:
      section, i = _SECTIONS[name]
      out[name] = trainable.build_agent(
          name, c[f"{section}_model"], c[f"{section}_optim"], c[f"{section}_loss"],
          env.tokenizer, mesh, jax.random.fold_in(key, i), init_dir=c.init,
          num_micro=c.num_micro, temperature=c.sampling.temperature, bases=bases,
          max_staleness=c.max_staleness,
          staleness_tis_cap=c.get("staleness_tis_cap", 2.0))
  return out


def expert_scorer(c) -> Callable | None:
  """r_expert of a sub-agent episode (algorithm.md 1.2's beta3), or None while beta[2] = 0.

  `config.sub_judge`: "grounded" (`rewards.GroundedJudge`: is the result read from the tool
  replies the sub-agent received?) or "module:callable", any judge (an LLM's) called with
  (subtask, result, tool replies); a failing judge raises `rewards.JudgeError`.
  """
  if not c.beta[2]:
    return None
  judge = load_judge(c.sub_judge)
  return lambda ep: rewards.expert_score(ep.task.subtask, ep.final or "",
                                         "\n".join(ep.observations), judge=judge)


@functools.cache
def load_judge(spec: str) -> rewards.Judge:
  """The judge `spec` names: "grounded", or "module:callable" (called with no arguments if
  it is a class or factory that returns the judge, else used as the judge itself).

  Loaded once per process and spec: a judge that loads a model is not rebuilt every step."""
  if spec == "grounded":
    return rewards.GroundedJudge()
  module, _, name = spec.partition(":")
  try:
    obj = getattr(importlib.import_module(module), name)
  except (ImportError, AttributeError, ValueError) as e:
    raise ConfigValueError(f"config.sub_judge={spec!r}; expected \"grounded\" or an importable "
                           f"\"module:callable\" ({e}).") from None
  return obj() if isinstance(obj, type) else obj


@dataclasses.dataclass(frozen=True)
class Program:
  """What an M-GRPO program sets up once (`start`): the config, its wiring, the mesh, the
  task, the agents it owns, their checkpointer and the first step to run; with
  `config.rollout_devices` the sampler's own mesh (`mesh` is then the training devices')."""

  c: ml_collections.ConfigDict
  wiring: Wiring
  mesh: jax.sharding.Mesh
  env: Env
  agents: dict
  ckpt: ckpt_lib.Checkpointer
  start: int
  rollout_mesh: jax.sharding.Mesh | None = None

  def run(self, workdir: str, *, rollout: loop.Rollout | None, learn: loop.Learn,
          train: loop.Train, evaluate: Callable[[int], dict], desc: str, show,
          schedule: loop.Schedule | None = None, play: Callable | None = None,
          versions: Callable | None = None, warm: Callable | None = None) -> dict:
    """Runs the program's phases (`loop.step_driver`) from `start` in the one training loop;
    the schedule is the config's unless given.

    With `config.max_staleness` >= 1 and `play(step, weights)` (a rollout from published
    sampler weights) the steps are pipelined (`pipeline.Pipeline`; `versions(rollouts)`:
    the behaviour versions the rows recorded, checked against the bound; `warm()`: the
    learner's host programs compiled while the first step plays).
    """
    schedule = schedule or loop.Schedule.of(self.c)
    k = self.c.get("max_staleness", 0)
    if play is None or k < 1:
      update = loop.step_driver(rollout=rollout, learn=learn, train=train)
    else:
      publisher = handoff.Handoff(self.agents, self.rollout_mesh,
                                  fixed=[a for a in self.agents if a not in self.wiring.trained])
      update = pipeline.Pipeline(
          play=play, learn=learn, train=train, publish=publisher.publish, k=k,
          start=self.start, num_steps=schedule.num_steps, versions=versions, warm=warm,
          timeline_dir=workdir if jax.process_index() == 0 else "")
    try:
      return loop.train_loop(
          workdir, self.agents, self.ckpt, schedule, start=self.start, update=update,
          evaluate=evaluate, tokenizer=self.env.tokenizer, desc=desc, show=show)
    finally:
      if hasattr(update, "close"):
        update.close()  # The rollout thread stops with the loop, an error's included.


def start(c: ml_collections.ConfigDict, workdir: str, *, only: str | None = None,
          training: bool = True, check: Callable = lambda c: None,
          batch_rows: Mapping[str, int] | None = None, agent_config: Callable | None = None,
          agent_key: jax.Array | None = None, checkpoints: str | dict = "",
          cache_dir: str | None = None, max_to_keep: int | None = None) -> Program:
  """Checks `c`, builds the task and the agents, and restores the latest checkpoint.

  `only`: the one role a decoupled program owns (the variant must have a separate sub-agent).
  `training=False`: the wiring's checks are evaluation's (SFT runs no RL step: one rollout
  and greedy sampling are fine). `check(c)`: the program's own config checks. `batch_rows`
  (field -> rows): the batches the mesh must divide. `agent_config(c)`, `agent_key`: the
  config and key the agents are built from (default: `c`, the seed's key folded with 0).
  `checkpoints` (default `<workdir>/checkpoints`), `cache_dir`, `max_to_keep` (default the
  config's): the checkpointer. A fresh run's config is written once every check has passed.
  """
  w = resolve_wiring(c, training=training)
  check(c)
  if only is not None and (w.merge or not w.has_sub):
    raise ConfigValueError(f"config.variant={c.variant!r} has no separate sub-agent; "
                           "decoupled runs need 'mgrpo' or 'frozen_sub'.")
  os.makedirs(workdir, exist_ok=True)
  mesh, rollout_mesh = meshes(c, pipelined=only is None)
  for field, rows in (batch_rows or {}).items():
    checks.check_batch_divides_mesh(rows, mesh, f"config.{field}")
  env = tasks.build_env(c)
  check_task(c, w, env)
  key = jax.random.fold_in(jax.random.key(c.seed), 0) if agent_key is None else agent_key
  agents = build_agents(agent_config(c) if agent_config else c, w, env, mesh, key, only=only)
  ckpt = ckpt_lib.Checkpointer(checkpoints or os.path.join(workdir, "checkpoints"),
                               cache_dir=cache_dir,
                               max_to_keep=c.max_to_keep if max_to_keep is None else max_to_keep)
  return Program(c, w, mesh, env, agents, ckpt, loop.resume(ckpt, agents, workdir, c),
                 rollout_mesh)


def meshes(c, *, pipelined: bool = True) -> tuple[jax.sharding.Mesh, jax.sharding.Mesh | None]:
  """(the training mesh, the sampler's mesh or None): `config.mesh` over all devices, or
  with `config.rollout_devices = N > 0` over the first N devices (the sampler's) and over
  the rest (training's). A split needs the pipeline (`max_staleness` >= 1) of the colocated
  program (`pipelined`)."""
  n = c.get("rollout_devices", 0)
  if not n:
    return sharding.make_mesh(dict(c.mesh)), None
  if not pipelined or c.get("max_staleness", 0) < 1:
    raise ConfigValueError(f"config.rollout_devices={n} gives the sampler devices of its own, "
                           "which only the colocated program's pipeline uses: set "
                           "config.max_staleness >= 1 (or rollout_devices=0).")
  try:
    rollout, train = handoff.split_devices(n)
    return sharding.make_mesh(dict(c.mesh), train), sharding.make_mesh(dict(c.mesh), rollout)
  except (ValueError, sharding.ShardingError) as e:
    raise ConfigValueError(f"config.rollout_devices={n} with config.mesh="
                           f"{dict(c.mesh)}: {e}") from None
