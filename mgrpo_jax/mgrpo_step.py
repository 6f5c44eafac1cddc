"""One M-GRPO step, read top to bottom like DESIGN.md's data-flow picture.

  rollouts    queries[Q] -> main episodes [Q, K]; delegations -> sub-agent episodes
  main side   R_M = reward_main(...), A_M = group_advantages(R_M), main batch
  sub side    R_S = reward_sub(..., R_M), (index, valid) = align(d, D),
              A_S = group_advantages(R_S[index], valid), sub batch
  update      each trained agent's train step

The variant (`config.variant`) is resolved once, by `resolve_wiring`, into a frozen `Wiring`
that every function here takes; nothing else reads it:
  mgrpo       main and sub-agent, separate weights, both trained (PAPERS.md 1)
  frozen_sub  the same rollouts, but the sub-agent's update is never run
  shared      one set of weights plays both roles; one update on both roles' rows
  single      one agent with every tool (single-agent GRPO), no sub-agent
  unaligned   mgrpo without trajectory alignment: every sub-agent episode once
Who serves the delegations is the caller's: the colocated program passes the in-process
`ColocatedSubAgent`, the decoupled main program an `ExchangeSubAgent`.
"""

import dataclasses
from typing import Mapping

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from mgrpo_jax import config_checks as checks
from mgrpo_jax import plumbing
from mgrpo_jax.agents import experts, protocol, rollout
from mgrpo_jax.research_env import Env, eval_questions
from mgrpo_jax.rl import advantages, hierarchy
from mgrpo_jax.rl import batch as batch_lib

MIN_LENGTH = 128  # Shortest batch length: episodes are a few hundred tokens, so one shape.


@dataclasses.dataclass(frozen=True)
class Wiring:
  """A variant as wiring: who plays which role, who trains, whether batches merge."""

  roles: tuple[str, ...]  # The rollout's roles; the first answers the question.
  agent_of: Mapping[str, str]  # Role -> the agent whose weights play it.
  trained: tuple[str, ...]  # Agents whose update runs.
  merge: bool  # One update on both roles' rows (one agent plays both).
  # Sub-agent rows: "sample" (trajectory alignment, PAPERS.md 1.4: D per rollout, drawn) or
  # "pad" (each rollout's calls once, none duplicated or dropped; padding rows masked).
  align: str = "sample"

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
                        align="pad"),
}


def _fields(training: bool) -> tuple[dict, dict]:
  """Every choice and numeric field of configs/mgrpo.py, with what it may hold."""
  choices = {"variant": tuple(WIRINGS), "policy": ("model", "expert"),
             "adv_scale": ("std", "none"), "align_on_empty": ("mask", "borrow")}
  # A group of one rollout has every advantage 0: training needs K >= 2 (evaluation: any).
  ranges = {"num_rollouts": checks.at_least(2 if training else 1),
            "adv_eps": checks.POSITIVE, "max_to_keep": checks.at_least(1),
            "max_staleness": checks.at_least(0), "seed": checks.at_least(0),
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
  checks.check_weights(c, "world.hop_weights")
  checks.check_world(c)
  checks.check_mesh(c)
  checks.check_turn_fits(c)
  if c.retrieval.backend == "http" and not c.retrieval.url:
    raise plumbing.ConfigValueError("config.retrieval.backend='http' needs config.retrieval.url "
                                    "(e.g. http://127.0.0.1:8000/retrieve).")
  w = WIRINGS[c.variant]
  rows = c.num_queries * c.num_rollouts
  if not w.has_sub and c.num_micro and rows % c.num_micro:
    raise plumbing.ConfigValueError(f"config.num_micro={c.num_micro} does not divide the batch "
                                    f"of num_queries*num_rollouts={rows}.")
  return w


def check_task(c: ml_collections.ConfigDict, w: Wiring, env: Env) -> None:
  """What the config asks of the built task: questions to train on, prompts that fit.

  The lead role's longest first prompt plus one turn must fit `limits.max_len`; a
  sub-agent's prompt is its template plus a subtask of at most one main turn.
  """
  if not env.train:
    raise plumbing.ConfigValueError(
        f"config.world.num_questions={c.world.num_questions} with "
        f"config.world.test_fraction={c.world.test_fraction} leaves no training question.")
  lim, skip = c.limits, 0 if c.world.system_prompt else 1
  messages = protocol.single_messages if w.lead == "single" else protocol.main_messages
  prompt = lambda m: len(env.tokenizer.apply_chat_template(m[skip:], add_generation_prompt=True))
  longest = max(prompt(messages(q.text)) for q in env.train + env.test)
  checks.check_prompt_fits(longest, f"the longest {w.lead} prompt",
                           max_len=lim.max_len, max_new_tokens=lim.max_new_tokens)
  if w.has_sub:
    checks.check_prompt_fits(prompt(protocol.sub_messages("")) + lim.max_new_tokens,
                             "a sub-agent prompt with a subtask of one main turn",
                             max_len=lim.max_len, max_new_tokens=lim.max_new_tokens)


def build_agents(c, w: Wiring, env: Env, mesh, key, *, only: str | None = None) -> dict:
  """The wiring's agents (or only agent `only`: a decoupled program owns just its own)."""
  out, bases = {}, {}  # LoRA agents on one checkpoint share its frozen copy.
  for name in w.agents:
    if only is None or name == only:
      section, i = _SECTIONS[name]
      out[name] = plumbing.build_agent(
          name, c[f"{section}_model"], c[f"{section}_optim"], c[f"{section}_loss"],
          env.tokenizer, mesh, jax.random.fold_in(key, i), init_dir=c.init,
          num_micro=c.num_micro, temperature=c.sampling.temperature, bases=bases)
  return out


# ----------------------------------------------------------------------------- rollouts

def limits(c) -> rollout.Limits:
  return rollout.Limits(**c.limits.to_dict())


def expert_policies(c, w: Wiring, env: Env, *, noise: float = 0.0, seed: int = 0) -> dict:
  """The scripted experts, one per role."""
  tok, kw = env.tokenizer, dict(noise=noise, think=c.expert_think)
  mk = lambda expert, i: rollout.ExpertPolicy(expert, tok, seed=seed * 10 + i)
  if not w.has_sub:
    return {"single": mk(experts.SingleExpert(search_k=c.world.search_k, **kw), 0)}
  return {"main": mk(experts.MainExpert(**kw), 0),
          "sub": mk(experts.SubExpert(search_k=c.world.search_k, **kw), 1)}


def make_policies(c, w: Wiring, env: Env, agents: dict, sampling_cfg, version: int) -> dict:
  """Turn policies per role: the agents' current weights (or `config.policy="expert"`).

  A role whose agent is not in `agents` is skipped: in a decoupled run the other program
  plays it.
  """
  if c.policy == "expert":
    return expert_policies(c, w, env, noise=c.expert_noise)
  kw = dict(limits=limits(c), temperature=sampling_cfg.temperature, top_p=sampling_cfg.top_p,
            top_k=sampling_cfg.top_k, version=version, chunk=sampling_cfg.chunk,
            kv_cache_budget_bytes=sampling_cfg.kv_cache_budget_bytes or None)
  return {role: rollout.LLMPolicy(agents[name].model_config, agents[name].params,
                                  env.tokenizer, role, mesh=agents[name].mesh, **kw)
          for role, name in w.agent_of.items() if name in agents}


def colocated_sub_agent(c, env: Env, policy, key) -> rollout.ColocatedSubAgent:
  """The sub-agent serving a step's delegations in this process (key: `fold_in(key, 1)`)."""
  sub_tools = {k: v for k, v in env.tools.items() if k in ("search", "visit")}
  return rollout.ColocatedSubAgent(policy, env.tokenizer, sub_tools, limits=limits(c),
                                   key=jax.random.fold_in(key, 1),
                                   system_prompt=c.world.system_prompt)


def run_rollouts(c, w: Wiring, env: Env, policies: dict, questions, *, num_rollouts: int, key,
                 step: int, service=None) -> tuple[list, list]:
  """Main (or single) episodes in (q, k) order, and the sub-agent's episodes.

  Delegations go to `service`; by default the sub-agent runs here (`colocated_sub_agent`).
  A service that keeps no episodes (the decoupled main program's) gives no sub episodes.
  """
  if not w.has_sub:
    eps = rollout.rollout_single(policies["single"], questions, num_rollouts=num_rollouts,
                                 tokenizer=env.tokenizer, limits=limits(c), key=key,
                                 tools=env.tools, step=step, system_prompt=c.world.system_prompt)
    return eps, []
  if service is None:
    service = colocated_sub_agent(c, env, policies["sub"], key)
  eps = rollout.rollout_main(policies["main"], service, questions, num_rollouts=num_rollouts,
                             tokenizer=env.tokenizer, limits=limits(c),
                             key=jax.random.fold_in(key, 0), step=step,
                             tools={"python": env.tools["python"]},
                             system_prompt=c.world.system_prompt)
  return eps, getattr(service, "episodes", [])


def overflowed(ep) -> bool:
  """Whether the episode was ended because its context would overflow `limits.max_len`."""
  return (ep.failure or "").startswith("aborted: context")


def episode_metrics(prefix: str, eps, outcome=None) -> dict:
  """Rates and counts that say what the agents did."""
  m = {f"{prefix}/format": float(np.mean([e.format_ok for e in eps])) if eps else 0.0,
       f"{prefix}/turns": float(np.mean([len(e.turns) for e in eps])) if eps else 0.0,
       f"{prefix}/gen_tokens": float(np.mean([e.num_generated for e in eps])) if eps else 0.0,
       f"{prefix}/overflow": float(np.mean([overflowed(e) for e in eps])) if eps else 0.0}
  if outcome is not None:
    m[f"{prefix}/reward"] = float(outcome.reward.mean())
    m[f"{prefix}/accuracy"] = float(outcome.correct.mean())
  if eps and eps[0].role == "main":
    m[f"{prefix}/delegations"] = float(np.mean([e.delegations for e in eps]))
  return m


def evaluate(c, w: Wiring, env: Env, agents: dict, *, step: int, questions=None,
             service=None) -> dict:
  """Held-out accuracy, format rate, turns and delegations per episode (greedy by default)."""
  questions = eval_questions(c, env) if questions is None else questions
  policies = make_policies(c, w, env, agents, c.eval_sampling, version=step)
  eps, sub_eps = run_rollouts(c, w, env, policies, questions, num_rollouts=1,
                              key=plumbing.eval_key(c, step), step=step, service=service)
  outcome = hierarchy.main_outcomes(eps, [q.answer for q in questions], len(questions), 1,
                                    alpha=tuple(c.alpha))
  m = episode_metrics("eval", eps, outcome)
  m.update(breakdown("eval", eps, outcome.correct[:, 0], questions))
  if sub_eps:
    m["eval/sub_format"] = float(np.mean([e.format_ok for e in sub_eps]))
    m["eval/sub_overflow"] = float(np.mean([overflowed(e) for e in sub_eps]))
  return m


def breakdown(prefix: str, eps, correct_Q, questions) -> dict:
  """Accuracy, context overflows and delegations by the pages a question needs (`hops<n>`),
  and by kind (`bridge`, and each comparison) where a question set has more than one."""
  groups: dict[str, list[int]] = {}
  kinds = {q.compare or "bridge" for q in questions}
  for i, q in enumerate(questions):
    groups.setdefault(f"hops{len(q.hops)}", []).append(i)
    if len(kinds) > 1:
      groups.setdefault(q.compare or "bridge", []).append(i)
  m = {}
  for name, idx in sorted(groups.items()):
    m[f"{prefix}/accuracy_{name}"] = float(np.mean([correct_Q[i] for i in idx]))
    m[f"{prefix}/overflow_{name}"] = float(np.mean([overflowed(eps[i]) for i in idx]))
    if eps[0].role == "main":
      m[f"{prefix}/delegations_{name}"] = float(np.mean([eps[i].delegations for i in idx]))
  return m


# --------------------------------------------------------------- main side, sub side

def main_side(c, w: Wiring, env: Env, eps) -> tuple[batch_lib.Batch, hierarchy.MainOutcome,
                                                     dict]:
  """R_M, A_M and the main (or single) agent's batch.

  The outcome is all the sub-agent needs from the main agent (a decoupled main program
  publishes it on the exchange).
  """
  q, k = c.num_queries, c.num_rollouts
  answers = [e.task.answer for e in eps[::k]]
  outcome = hierarchy.main_outcomes(eps, answers, q, k, alpha=tuple(c.alpha))
  adv_m = advantages.group_advantages(jnp.asarray(outcome.reward), scale=c.adv_scale,
                                      eps=c.adv_eps)
  batch = batch_lib.make_batch(eps, np.asarray(adv_m).reshape(-1), max_len=c.limits.max_len,
                               pad_id=env.tokenizer.pad_id, minimum=MIN_LENGTH)
  return batch, outcome, episode_metrics(w.lead, eps, outcome)


def sub_advantages(aligned: hierarchy.AlignedSub, *, scale: str, eps: float) -> np.ndarray:
  """A_S[Q, K, D]: R_S of the aligned rows, normalised per query over its valid rows."""
  return np.asarray(advantages.group_advantages(
      jnp.asarray(aligned.rewards_QxKxD), valid=jnp.asarray(aligned.valid_QxKxD), scale=scale,
      eps=eps))


def sub_side(c, env: Env, sub_eps, outcome: hierarchy.MainOutcome, key, *,
             align: str = "sample") -> tuple[batch_lib.Batch, dict]:
  """R_S from the main outcome, alignment to [Q, K, D] (drawn with `key`), A_S, sub batch.

  `align="pad"` (the `unaligned` variant) takes every episode once instead: D is
  `limits.max_delegations` (no rollout has more calls), rows past a rollout's calls are
  invalid, and the batch keeps the valid rows, padded to a multiple of Q*K (few shapes).
  """
  r_s = hierarchy.sub_rewards(sub_eps, outcome, beta=tuple(c.beta))
  if align == "pad":
    aligned = hierarchy.pad_sub(sub_eps, r_s, c.num_queries, c.num_rollouts,
                                c.limits.max_delegations)
  else:
    aligned = hierarchy.align_sub(sub_eps, r_s, c.num_queries, c.num_rollouts, c.align_d, key,
                                  on_empty=c.align_on_empty)
  adv_s = sub_advantages(aligned, scale=c.adv_scale, eps=c.adv_eps).reshape(-1)
  rows = aligned.episodes
  if align == "pad":
    keep = [i for i, ep in enumerate(rows) if ep is not None]
    # Rows in whole multiples of Q*K (the main batch's size, which the mesh divides): at
    # most max_delegations shapes to compile.
    unit = c.num_queries * c.num_rollouts
    width = unit * max(1, -(-len(keep) // unit))
    rows = [rows[i] for i in keep] + [None] * (width - len(keep))
    adv_s = np.concatenate([adv_s[keep], np.zeros(width - len(keep), np.float32)])
  batch = batch_lib.make_batch(rows, adv_s, max_len=c.limits.max_len,
                               pad_id=env.tokenizer.pad_id, minimum=MIN_LENGTH)
  m = episode_metrics("sub", sub_eps)
  m["sub/reward"] = float(r_s.mean()) if len(r_s) else 0.0
  m.update(aligned.stats)
  return batch, m


def batches(c, w: Wiring, env: Env, eps, sub_eps, key) -> tuple[dict, dict]:
  """Both sides of a step: a batch per role and the metrics (`key` draws the alignment)."""
  batch, outcome, m = main_side(c, w, env, eps)
  out = {w.lead: batch}
  if w.has_sub:
    out["sub"], sub_m = sub_side(c, env, sub_eps, outcome, key, align=w.align)
    m.update(sub_m)
  return out, m


def update(w: Wiring, agents: dict, role_batches: dict, step: int) -> dict:
  """Runs the train step of each trained agent present here on its roles' rows."""
  if w.merge:  # One set of weights: one update on both roles' rows.
    role_batches = {w.lead: batch_lib.concat(list(role_batches.values()))}
  by_agent = {w.agent_of[role]: b for role, b in role_batches.items()
              if w.agent_of[role] in w.trained and w.agent_of[role] in agents}
  return plumbing.update_agents(agents, by_agent, step)
