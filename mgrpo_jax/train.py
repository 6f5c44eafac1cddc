"""Colocated M-GRPO training (both roles in one process) and the paper's ablations.

Variants are wiring chosen at setup, never flags inside a jitted step:
  mgrpo       main and sub-agent, separate weights, both trained (PAPERS.md 1)
  frozen_sub  the same rollouts, but the sub-agent's update is never run
  shared      one set of weights plays both roles; one update on both roles' rows
  single      one agent with every tool (single-agent GRPO), no sub-agent
"""

import dataclasses
import functools
import json
import os
import time
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from absl import logging

from mgrpo_jax import checkpoint as ckpt_lib
from mgrpo_jax import decoupled  # Imports this module back; both use the other lazily.
from mgrpo_jax import metrics as metrics_lib
from mgrpo_jax import models, sharding
from mgrpo_jax import tokenizer as tk
from mgrpo_jax.agents import experts, protocol, rollout
from mgrpo_jax.envs import python_tool, search, world
from mgrpo_jax.rl import advantages, hierarchy
from mgrpo_jax.rl import train_step as ts

ROLES = {"mgrpo": ("main", "sub"), "frozen_sub": ("main", "sub"), "shared": ("main", "sub"),
         "single": ("single",)}


class ConfigValueError(ValueError):
  """A config field holds a value the programs cannot use; the message names the field."""


_CHOICES = {
    "variant": tuple(ROLES), "policy": ("model", "expert"), "adv_scale": ("std", "none"),
    "align_on_empty": ("mask", "borrow"), "main_loss.kind": ("clipped", "reinforce"),
    "sub_loss.kind": ("clipped", "reinforce"), "main_loss.nonfinite": ("raise", "skip"),
    "sub_loss.nonfinite": ("raise", "skip"),
    "main_loss.agg": ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum"),
    "sub_loss.agg": ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum"),
    "main_loss.kl_estimator": ("k1", "k2", "k3"), "sub_loss.kl_estimator": ("k1", "k2", "k3"),
}
_POSITIVE = ("num_queries", "num_rollouts", "align_d", "num_steps", "eval_every",
             "num_eval_questions", "checkpoint_every", "num_micro", "limits.max_turns",
             "limits.max_new_tokens", "limits.max_len", "limits.max_delegations",
             "main_optim.learning_rate", "sub_optim.learning_rate")


def _field(c, path: str):
  for part in path.split("."):
    c = c[part]
  return c


def validate_config(c: ml_collections.ConfigDict) -> None:
  """Fails at start-up, naming the field, instead of deep inside a step."""
  for path, choices in _CHOICES.items():
    if _field(c, path) not in choices:
      raise ConfigValueError(f"config.{path}={_field(c, path)!r}; expected one of {choices}.")
  for path in _POSITIVE:
    if not _field(c, path) > 0:
      raise ConfigValueError(f"config.{path}={_field(c, path)!r} must be > 0.")
  if len(c.alpha) != 2 or len(c.beta) != 3:
    raise ConfigValueError(f"config.alpha needs 2 weights and config.beta 3, got "
                           f"{tuple(c.alpha)} and {tuple(c.beta)}.")
  if c.sampling.temperature <= 0:
    raise ConfigValueError("config.sampling.temperature must be > 0 for training rollouts "
                           "(behaviour log-probs are taken at that temperature).")
  if c.variant == "single" and c.num_micro and (c.num_queries * c.num_rollouts) % c.num_micro:
    raise ConfigValueError(f"config.num_micro={c.num_micro} does not divide the batch of "
                           f"num_queries*num_rollouts={c.num_queries * c.num_rollouts}.")


def check_batch_divides_mesh(rows: int, mesh, field: str) -> None:
  """Batches are split over (data, fsdp): the row count must divide evenly."""
  shards = mesh.shape["data"] * mesh.shape["fsdp"]
  if rows % shards:
    raise ConfigValueError(f"{field} gives batches of {rows} rows, which do not split over "
                           f"data*fsdp={shards} devices of config.mesh; change one of them.")


@dataclasses.dataclass
class Env:
  """The task: tokenizer, world, question splits and tools."""

  tokenizer: tk.Tokenizer
  train: list
  test: list
  index: search.SearchIndex
  tools: dict


def build_env(c: ml_collections.ConfigDict) -> Env:
  """The offline research world with its train/test split and tools."""
  w = c.world
  wcfg = world.WorldConfig(seed=w.seed, num_people=w.num_people, num_orgs=w.num_orgs,
                           num_places=w.num_places, num_works=w.num_works,
                           num_countries=w.num_countries, num_rivers=w.num_rivers,
                           distractors_per_doc=w.distractors_per_doc,
                           name_similarity=w.name_similarity)
  the_world = world.generate_world(wcfg)
  questions = world.make_questions(the_world, num=w.num_questions,
                                   hop_weights=tuple(w.hop_weights), seed=w.seed)
  train, test = world.split_questions(questions, w.test_fraction, seed=w.seed)
  index = search.SearchIndex(the_world.documents)
  tools = dict(search.local_tools(index, k=w.search_k, max_chars=w.visit_chars),
               python=python_tool.PythonTool())
  tokenizer = tk.load_tokenizer(c.tokenizer, words=tokenizer_words(c.tokenizer, the_world))
  return Env(tokenizer, train, test, index, tools)


def tokenizer_words(spec: str, the_world: world.World) -> tuple[str, ...]:
  """The plain-text words a byte tokenizer gives one id each (see `tk.load_tokenizer`).

  "byte+names": the world's names, doc ids and question stems. "byte+world": those, the page
  templates' phrases, the chat role lines and the protocol's prompt openings: what a
  tokenizer trained on the world's traces would make single tokens.
  """
  if spec == "byte+world":
    words = world.vocabulary(the_world, phrases=True) + tk.ROLE_WORDS + protocol.PROMPT_WORDS
    return tuple(dict.fromkeys(words))
  return world.vocabulary(the_world) if spec == "byte+names" else ()


@dataclasses.dataclass
class Agent:
  """One trainable policy: its model, objective, optimizer and jitted update."""

  name: str
  model_config: models.Qwen3Config
  loss_config: ts.LossConfig
  state: ts.TrainState
  step_fn: Any
  nonfinite: str


def _runtime(mc) -> dict:
  """The model config's runtime fields (how it computes, not what it is)."""
  return dict(remat=mc.remat, attention=mc.attention, attention_block=mc.attention_block)


def _model_params(mc, tokenizer, key, mesh, init_dir: str, name: str):
  """Parameters from an SFT warm start, an HF checkpoint, or a random preset."""
  path = os.path.join(init_dir, "hf", name) if init_dir else mc.hf_path
  if path:
    cfg, params = models.load_hf(path, mesh=mesh, dtype=jnp.dtype(mc.param_dtype),
                                 compute_dtype=jnp.dtype(mc.compute_dtype))
    _check_vocabulary(path, cfg.vocab_size, tokenizer)
    return cfg.replace(**_runtime(mc)), params
  vocab = tokenizer.vocab_size if mc.vocab_size == -1 else mc.vocab_size
  cfg = models.get_preset(mc.preset, vocab_size=vocab, param_dtype=mc.param_dtype,
                          compute_dtype=mc.compute_dtype, **_runtime(mc))
  return cfg, models.init_params(cfg, key, mesh=mesh)


def loss_config(lc, temperature: float) -> ts.LossConfig:
  return ts.LossConfig(kind=lc.kind, eps_low=lc.eps_low, eps_high=lc.eps_high,
                       dual_clip=lc.dual_clip or None, agg=lc.agg, kl_coef=lc.kl_coef,
                       kl_estimator=lc.kl_estimator, temperature=temperature)


def build_agent(name, mc, oc, lc, tokenizer, mesh, key, *, init_dir="", num_micro=1,
                temperature=1.0) -> Agent:
  """An agent with its state placed on `mesh` and its train step jitted once."""
  cfg, params = _model_params(mc, tokenizer, jax.random.fold_in(key, 0), mesh, init_dir, name)
  tx = ts.make_optimizer(learning_rate=oc.learning_rate, b1=oc.b1, b2=oc.b2, eps=oc.eps,
                         weight_decay=oc.weight_decay, grad_clip=oc.grad_clip)
  state = ts.init_state(params, tx, jax.random.fold_in(key, 1))
  st_sh = ts.state_shardings(state, mesh)
  state = jax.device_put(state, st_sh)
  lcfg = loss_config(lc, temperature)
  step_fn = ts.make_train_step(cfg, lcfg, tx, num_micro=num_micro, mesh=mesh,
                               state_sharding=st_sh,
                               max_tokens_per_micro=mc.max_tokens_per_micro or None,
                               logits_chunk=mc.logits_chunk)
  return Agent(name, cfg, lcfg, state, step_fn, lc.nonfinite)


def build_agents(c, env: Env, mesh, key) -> dict[str, Agent]:
  """The variant's trainable agents ('shared' has one agent playing both roles)."""
  roles = ROLES[c.variant]
  mk = functools.partial(build_agent, tokenizer=env.tokenizer, mesh=mesh, init_dir=c.init,
                         num_micro=c.num_micro, temperature=c.sampling.temperature)
  if c.variant == "single":
    return {"single": mk("single", c.main_model, c.main_optim, c.main_loss,
                         key=jax.random.fold_in(key, 0))}
  agents = {"main": mk("main", c.main_model, c.main_optim, c.main_loss,
                       key=jax.random.fold_in(key, 0))}
  if c.variant != "shared":
    agents["sub"] = mk("sub", c.sub_model, c.sub_optim, c.sub_loss,
                       key=jax.random.fold_in(key, 1))
  del roles
  return agents


def _limits(c) -> rollout.Limits:
  return rollout.Limits(**c.limits.to_dict())


def make_policies(c, env: Env, agents: dict, sampling_cfg, version: int, *,
                  expert_noise: float = 0.0, seed: int = 0) -> dict:
  """Turn policies per role: the agents' current weights, or the scripted experts."""
  if c.policy == "expert":
    tok, kw = env.tokenizer, dict(noise=expert_noise, think=c.expert_think)
    mk = lambda expert, i: rollout.ExpertPolicy(expert, tok, seed=seed * 10 + i)
    if c.variant == "single":
      return {"single": mk(experts.SingleExpert(search_k=c.world.search_k, **kw), 0)}
    return {"main": mk(experts.MainExpert(**kw), 0),
            "sub": mk(experts.SubExpert(search_k=c.world.search_k, **kw), 1)}
  limits = _limits(c)
  kw = dict(limits=limits, temperature=sampling_cfg.temperature, top_p=sampling_cfg.top_p,
            top_k=sampling_cfg.top_k, version=version, chunk=sampling_cfg.chunk)
  out = {}
  for role in ROLES[c.variant]:
    agent = agents["main"] if (c.variant == "shared" and role == "sub") else agents.get(role)
    if agent is None:
      continue  # Decoupled: the other program owns this role.
    out[role] = rollout.LLMPolicy(agent.model_config, agent.state.params, env.tokenizer, role,
                                  **kw)
  return out


def run_rollouts(c, env: Env, policies: dict, questions, *, num_rollouts: int, key, step: int,
                 service=None):
  """Main (or single) episodes in (q, k) order, and the sub-agent episodes.

  By default the sub-agent runs here, behind an in-memory exchange
  (`loopback_sub_agent`). `service` replaces it (decoupled runs pass the exchange's);
  its episodes then stay with the other program and the second result is empty.
  """
  limits = _limits(c)
  tok = env.tokenizer
  if c.variant == "single":
    eps = rollout.rollout_single(policies["single"], questions, num_rollouts=num_rollouts,
                                 tokenizer=tok, limits=limits, key=key, tools=env.tools,
                                 step=step, system_prompt=c.world.system_prompt)
    return eps, []
  if service is None:
    service = loopback_sub_agent(c, env, policies["sub"], key, step)
  eps = rollout.rollout_main(policies["main"], service, questions, num_rollouts=num_rollouts,
                             tokenizer=tok, limits=limits, key=jax.random.fold_in(key, 0),
                             step=step, tools={"python": env.tools["python"]},
                             system_prompt=c.world.system_prompt)
  return eps, getattr(service, "episodes", [])


def colocated_sub_agent(c, env: Env, policy, key) -> rollout.ColocatedSubAgent:
  """The sub-agent serving a step's delegations (its key: `fold_in(step key, 1)`)."""
  sub_tools = {k: v for k, v in env.tools.items() if k in ("search", "visit")}
  return rollout.ColocatedSubAgent(policy, env.tokenizer, sub_tools, limits=_limits(c),
                                   key=jax.random.fold_in(key, 1),
                                   system_prompt=c.world.system_prompt)


def loopback_sub_agent(c, env: Env, policy, key, step: int) -> "decoupled.LoopbackSubAgent":
  """The colocated sub-agent behind the decoupled programs' exchange code.

  Each call gets a fresh `memory://` store, so a long run holds one step's records at
  most; requests, results and R_M cross it as they would between two programs.
  """
  return decoupled.LoopbackSubAgent(decoupled.memory_exchange(),
                                    colocated_sub_agent(c, env, policy, key), step=step)


def eval_key(c, step: int):
  return jax.random.fold_in(jax.random.key(c.seed + 1), step)


def step_key(c, step: int):
  return jax.random.fold_in(jax.random.fold_in(jax.random.key(c.seed), 1), step)


def episode_metrics(prefix: str, eps, outcome=None) -> dict:
  """Rates and counts that say what the agents did."""
  m = {f"{prefix}/format": float(np.mean([e.format_ok for e in eps])) if eps else 0.0,
       f"{prefix}/turns": float(np.mean([len(e.turns) for e in eps])) if eps else 0.0,
       f"{prefix}/gen_tokens": float(np.mean([e.num_generated for e in eps])) if eps else 0.0}
  if outcome is not None:
    m[f"{prefix}/reward"] = float(outcome.reward.mean())
    m[f"{prefix}/accuracy"] = float(outcome.correct.mean())
  if eps and eps[0].role == "main":
    m[f"{prefix}/delegations"] = float(np.mean([e.delegations for e in eps]))
  return m


def evaluate(c, env: Env, agents: dict, *, step: int, questions=None, service=None) -> dict:
  """Held-out accuracy, format rate, turns and delegations per episode (greedy by default)."""
  questions = eval_questions(c, env) if questions is None else questions
  policies = make_policies(c, env, agents, c.eval_sampling, version=step)
  eps, sub_eps = run_rollouts(c, env, policies, questions, num_rollouts=1,
                              key=eval_key(c, step), step=step, service=service)
  outcome = hierarchy.main_outcomes(eps, [q.answer for q in questions], len(questions), 1,
                                    alpha=tuple(c.alpha))
  m = episode_metrics("eval", eps, outcome)
  if sub_eps:
    m["eval/sub_format"] = float(np.mean([e.format_ok for e in sub_eps]))
  return m


def main_batch(c, env, eps) -> tuple[dict, hierarchy.MainOutcome, dict]:
  """The main (or single) agent's side of a step: R_M, A_M and its batch.

  The outcome is all the sub-agent needs from the main agent (decoupled runs send it over
  the exchange).
  """
  q, k = c.num_queries, c.num_rollouts
  answers = [e.task.answer for e in eps[::k]]
  outcome = hierarchy.main_outcomes(eps, answers, q, k, alpha=tuple(c.alpha))
  adv_m = np.asarray(advantages.group_advantages(jnp.asarray(outcome.reward),
                                                 scale=c.adv_scale, eps=c.adv_eps))
  role = "single" if c.variant == "single" else "main"
  length = hierarchy.batch_length(eps, c.limits.max_len)
  batch = hierarchy.make_batch(eps, adv_m.reshape(-1), length=length,
                               pad_id=env.tokenizer.pad_id)
  return batch, outcome, episode_metrics(role, eps, outcome)


def sub_batch(c, env, sub_eps, outcome: hierarchy.MainOutcome, key) -> tuple[dict, dict]:
  """The sub-agent's side: R_S from the main outcome, alignment to [Q, K, D], A_S, batch."""
  r_s = hierarchy.sub_rewards(sub_eps, outcome, beta=tuple(c.beta))
  aligned = hierarchy.align_sub(sub_eps, r_s, c.num_queries, c.num_rollouts, c.align_d, key,
                                on_empty=c.align_on_empty, scale=c.adv_scale, eps=c.adv_eps)
  length = hierarchy.batch_length(aligned.episodes, c.limits.max_len)
  batch = hierarchy.make_batch(aligned.episodes, aligned.advantages_QxKxD.reshape(-1),
                               length=length, pad_id=env.tokenizer.pad_id)
  m = episode_metrics("sub", sub_eps)
  m["sub/reward"] = float(r_s.mean()) if len(r_s) else 0.0
  m.update(aligned.stats)
  return batch, m


def eval_questions(c, env: Env) -> list:
  return env.test[:c.num_eval_questions]


def _batches(c, env, eps, sub_eps, key, service=None) -> tuple[dict, dict]:
  """Both sides of a colocated step: one batch per role, and their metrics.

  With a `LoopbackSubAgent` as `service`, the sub-agent's side takes the main outcome
  from the exchange, as a decoupled sub-agent does.
  """
  role = "single" if c.variant == "single" else "main"
  batch, outcome, m = main_batch(c, env, eps)
  batches = {role: batch}
  if role == "main":
    if service is not None:
      outcome = service.relay_outcome(outcome)
    batches["sub"], sm = sub_batch(c, env, sub_eps, outcome, key)
    m.update(sm)
  return batches, m


def _update(c, agents: dict, batches: dict, step: int) -> dict:
  """Runs each trained agent's step (wiring decides who trains) and returns metrics."""
  if c.variant == "shared":
    # One set of weights, one update on both roles' rows (padded to a common length).
    length = max(b["tokens"].shape[1] for b in batches.values())
    pad = lambda x: np.pad(x, [(0, 0), (0, length - x.shape[1])] if x.ndim == 2 else [(0, 0)])
    merged = {name: np.concatenate([pad(b[name]) for b in batches.values()])
              for name in batches["main"]}
    batches = {"main": merged}
  trained = [n for n in batches if n in agents and not (c.variant == "frozen_sub" and n == "sub")]
  out = {}
  for name in trained:
    agent = agents[name]
    agent.state, metrics = agent.step_fn(agent.state, batches[name])
    metrics = jax.device_get(metrics)
    ts.check_finite(metrics, step, agent=name, policy=agent.nonfinite)
    out.update({f"{name}/{k}": float(v) for k, v in metrics.items()})
  return out


def restore_agents(ckpt: ckpt_lib.Checkpointer, agents: dict) -> int:
  """Loads the latest checkpoint into `agents` (in place); returns its step, 0 if none."""
  if ckpt.latest_step() is None:
    return 0
  states, meta = ckpt.restore(abstract_states={n: a.state for n, a in agents.items()})
  for n, a in agents.items():
    a.state = states[n]
  logging.info("Restored %s at step %d.", ckpt.directory, int(meta["step"]))
  return int(meta["step"])


def save_after_step(ckpt: ckpt_lib.Checkpointer, agents: dict, step: int, *, every: int,
                    last: int) -> None:
  """Checkpoints the agents after `step` every `every` steps and after the last one."""
  if (step + 1) % every == 0 or step + 1 == last:
    ckpt.save(step + 1, {n: a.state for n, a in agents.items()}, {"step": step + 1})


def _questions_for_step(train: list, step: int, q: int, seed: int) -> list:
  """Deterministic data order from (seed, step): a resumed run sees the same questions."""
  n = len(train)
  idx = []
  for i in range(step * q, (step + 1) * q):
    epoch, pos = divmod(i, n)
    perm = np.random.default_rng([seed, epoch]).permutation(n)
    idx.append(perm[pos])
  return [train[i] for i in idx]


_WORDS_FILE = "byte_tokenizer_words.json"  # Next to a saved model trained with ByteTokenizer words.


def _check_vocabulary(path: str, vocab_size: int, tokenizer: tk.Tokenizer) -> None:
  """Refuses a checkpoint made with another tokenizer (its ids would mean other strings)."""
  if vocab_size < tokenizer.vocab_size:
    raise ValueError(f"{path}: the checkpoint has {vocab_size} token ids but the tokenizer has "
                     f"{tokenizer.vocab_size}; it was trained with another tokenizer (config."
                     f"tokenizer or config.world changed?): rerun the warm start.")
  words_file = os.path.join(path, _WORDS_FILE)
  if os.path.exists(words_file):
    with open(words_file) as f:
      saved = tuple(json.load(f)["words"])
    if saved != tuple(getattr(tokenizer, "words", ())):
      raise ValueError(f"{words_file}: the checkpoint was trained with other tokenizer words "
                       f"than this run's tokenizer has (config.tokenizer or config.world "
                       f"changed?): rerun the warm start.")


def _save_final_hf(workdir: str, agents: dict, tokenizer: tk.Tokenizer | None = None) -> None:
  """Final weights as HF checkpoints under workdir/hf/<agent> (an `init=` for later runs)."""
  for name, agent in agents.items():
    path = os.path.join(workdir, "hf", name)
    models.save_hf(path, agent.model_config, jax.device_get(agent.state.params))
    if getattr(tokenizer, "words", ()):
      with open(os.path.join(path, _WORDS_FILE), "w") as f:
        json.dump({"words": list(tokenizer.words)}, f)


def train_and_evaluate(c: ml_collections.ConfigDict, workdir: str) -> dict:
  """Trains `c.variant` for `c.num_steps`, resuming from `workdir` if it holds a checkpoint."""
  validate_config(c)
  os.makedirs(workdir, exist_ok=True)
  mesh = sharding.make_mesh(dict(c.mesh))
  rows = c.num_queries * c.num_rollouts
  check_batch_divides_mesh(rows, mesh, "config.num_queries*num_rollouts")
  check_batch_divides_mesh(rows * c.align_d, mesh, "config.num_queries*num_rollouts*align_d")
  env = build_env(c)
  root = jax.random.key(c.seed)
  agents = build_agents(c, env, mesh, jax.random.fold_in(root, 0))
  ckpt = ckpt_lib.Checkpointer(os.path.join(workdir, "checkpoints"), max_to_keep=c.max_to_keep)
  start = restore_agents(ckpt, agents)
  if not start:
    with open(os.path.join(workdir, "config.json"), "w") as f:
      f.write(c.to_json_best_effort(indent=2))
  writer = metrics_lib.MetricsWriter(workdir)
  writer.truncate_after(start - 1)
  progress = metrics_lib.Progress(c.num_steps, initial=start, desc=f"{c.variant}")
  last = {}
  for step in range(start, c.num_steps + 1):
    m = {}
    if step % c.eval_every == 0 or step == c.num_steps:
      m.update(evaluate(c, env, agents, step=step))
    if step == c.num_steps:
      writer.write(step, m)
      break
    t0 = time.perf_counter()
    key = step_key(c, step)
    questions = _questions_for_step(env.train, step, c.num_queries, c.seed)
    policies = make_policies(c, env, agents, c.sampling, version=step)
    svc = None if c.variant == "single" else loopback_sub_agent(c, env, policies["sub"], key,
                                                                step)
    eps, sub_eps = run_rollouts(c, env, policies, questions, num_rollouts=c.num_rollouts,
                                key=key, step=step, service=svc)
    t_roll = time.perf_counter() - t0
    batches, bm = _batches(c, env, eps, sub_eps, jax.random.fold_in(key, 2), svc)
    m.update(bm)
    m.update(_update(c, agents, batches, step))
    dt = time.perf_counter() - t0
    gen = sum(e.num_generated for e in eps) + sum(e.num_generated for e in sub_eps)
    m.update({"time/step_s": dt, "time/rollout_s": t_roll, "tokens_per_s": gen / t_roll})
    writer.write(step, m)
    last = m
    progress.update(1, {k: m[k] for k in ("main/reward", "single/reward", "eval/accuracy")
                        if k in m})
    save_after_step(ckpt, agents, step, every=c.checkpoint_every, last=c.num_steps)
  ckpt.wait()
  ckpt.close()
  writer.close()
  progress.close()
  _save_final_hf(workdir, agents, env.tokenizer)
  return last
