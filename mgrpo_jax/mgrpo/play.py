"""M-GRPO's play: the turn policies, the rollouts and the held-out evaluation.

Who serves the delegations is the caller's: the colocated program passes the in-process
`ColocatedSubAgent` (`colocated_sub_agent`), the decoupled main program an
`ExchangeSubAgent` (`delegation`).
"""

import dataclasses
import json
import os

import jax
import numpy as np

from mgrpo_jax import keys
from mgrpo_jax.agents import experts, qa_experts, rollout
from mgrpo_jax.config_checks import ConfigValueError
from mgrpo_jax.envs import qa
from mgrpo_jax.rl import rewards
from mgrpo_jax.mgrpo.tasks import Env, eval_questions
from mgrpo_jax.mgrpo.setup import Wiring
from mgrpo_jax.mgrpo import hierarchy


@dataclasses.dataclass(frozen=True)
class Rollouts:
  """A step's rollouts as the programs hand them to the step (`mgrpo.step.batches`).

  `questions` are the step's, in the order asked: main episode (q, k) answers
  `questions[q]`. A decoupled program holds one column: the main program no sub-agent
  episodes (`service`: the exchange it delegated over), the sub program no main episodes
  (it reads R_M from the exchange when it learns).
  """

  env: Env  # The step's task: its tools served the episodes.
  questions: list
  episodes: list  # Main (or single) episodes in (q, k) order.
  sub_episodes: list
  service: object = None

  @property
  def num_generated(self) -> int:
    return sum(e.num_generated for e in self.episodes + self.sub_episodes)


def behaviour_versions(r: Rollouts) -> list[int]:
  """Every policy version a step's rows were sampled by: each main (or single) episode's,
  the sub-agent version that served each of its delegations, each sub-agent episode's."""
  out = [ep.policy_version for ep in r.episodes + r.sub_episodes]
  return out + [v for ep in r.episodes for v in getattr(ep, "delegation_versions", ())]


def limits(c) -> rollout.Limits:
  return rollout.Limits(**c.limits.to_dict())


def expert_policies(c, w: Wiring, env: Env, *, noise: float = 0.0, seed: int = 0,
                    version: int = 0) -> dict:
  """The scripted experts, one per role; `version` labels what they play (they have no
  weights: only the versions' bookkeeping follows it)."""
  tok, kw = env.tokenizer, dict(noise=noise, think=c.expert_think)
  mk = lambda expert, i: rollout.ExpertPolicy(expert, tok, seed=seed * 10 + i,
                                              protocol=c.get("protocol", "tags"),
                                              version=version)
  if "data" in c:  # task=qa: the gold structure's experts (noise-free; none for "jsonl").
    if not w.has_sub:
      raise ConfigValueError("task=qa has experts for the main and sub-agent only, not for "
                             f"variant={c.variant!r}.")
    known = qa_experts.oracle(env.train + env.test)
    return {"main": mk(qa_experts.QAMainExpert(think=c.expert_think), 0),
            "sub": mk(qa_experts.QASubExpert(known, c.world.search_k, c.expert_think), 1)}
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
    return expert_policies(c, w, env, noise=c.expert_noise, version=version)
  kw = dict(limits=limits(c), temperature=sampling_cfg.temperature, top_p=sampling_cfg.top_p,
            top_k=sampling_cfg.top_k, version=version, chunk=sampling_cfg.chunk,
            kv_cache_budget_bytes=sampling_cfg.kv_cache_budget_bytes or None,
            protocol=c.get("protocol", "tags"), slots=sampling_cfg.get("slots", 0),
            share_prompts=sampling_cfg.get("share_prompts", False))
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


def score(c, prefix: str, questions, episodes,
          num_rollouts: int) -> tuple[hierarchy.MainOutcome, dict]:
  """R_M[Q, K] of the main (or single) episodes of `questions` (algorithm.md 1.2), and the
  metrics under `prefix` that say what the agents did: training's and evaluation's."""
  outcome = hierarchy.main_outcomes(episodes, [q.answers for q in questions], len(questions),
                                    num_rollouts, alpha=tuple(c.alpha))
  return outcome, episode_metrics(prefix, episodes, outcome)


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
             service=None, questions_file: str = "") -> dict:
  """Held-out accuracy, format rate, turns and delegations per episode (greedy by default).

  `questions_file`: where process 0 writes each question's correctness and each sub-agent
  call's (`question_record`), for question-level comparisons between runs.
  """
  questions = eval_questions(c, env) if questions is None else questions
  policies = make_policies(c, w, env, agents, c.eval_sampling, version=step)
  eps, sub_eps = run_rollouts(c, w, env, policies, questions, num_rollouts=1,
                              key=keys.eval_key(c, step), step=step, service=service)
  outcome, m = score(c, "eval", questions, eps, 1)
  if questions_file and jax.process_index() == 0:
    record = dict(step=step, **question_record(questions, outcome.correct[:, 0], sub_eps))
    os.makedirs(os.path.dirname(questions_file) or ".", exist_ok=True)
    with open(questions_file + ".tmp", "w") as f:
      json.dump(record, f)
    os.replace(questions_file + ".tmp", questions_file)
  m.update(breakdown("eval", eps, outcome.correct[:, 0], questions))
  if "data" in c:  # task=qa: token F1 and the retrieval recall of each hop's support.
    m.update(qa.eval_metrics("eval", questions, eps, sub_eps, env.index))
  if sub_eps:
    m["eval/sub_format"] = float(np.mean([e.format_ok for e in sub_eps]))
    m["eval/sub_overflow"] = float(np.mean([overflowed(e) for e in sub_eps]))
  return m


def questions_path(workdir: str, step: int) -> str:
  """Where a program writes the per-question record of its evaluation at `step`."""
  return os.path.join(workdir, "eval_questions", f"step_{step}.json")


def question_record(questions, correct_Q, sub_eps) -> dict:
  """Each question's correctness (in `questions`' order) and each sub-agent call's
  (`sub_call_correct`). A decoupled main program sees no sub episodes: no calls."""
  correct = [bool(x) for x in np.asarray(correct_Q)]
  calls = [dict(q=ep.q, call=ep.call, correct=sub_call_correct(ep, questions[ep.q]))
           for ep in sub_eps]
  return dict(question_ids=[q.id for q in questions], correct=correct, sub_calls=calls,
              accuracy=round(float(np.mean(correct)), 4) if correct else None,
              sub_call_accuracy=round(float(np.mean([x["correct"] for x in calls])), 4)
              if calls else None)


def sub_call_correct(ep, question) -> bool:
  """Whether a sub-agent episode answered a hop of `question`'s chain: asked about the hop's
  entity, its result holds the hop's answer (normalised). Real QA data's hops name no entity:
  there the result must hold an accepted answer of one of the hops."""
  if not ep.format_ok:
    return False
  result = rewards.normalize_answer(ep.final or "")
  subtask = ep.task.subtask.lower()
  for hop in question.hops:
    entity = getattr(hop, "entity", None)
    if entity is None:
      accepted = {rewards.normalize_answer(a) for a in hop.answers} - {""}
      if any(a in result for a in accepted):
        return True
    elif entity.lower() in subtask:
      return rewards.normalize_answer(hop.answer) in result
  return False


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
