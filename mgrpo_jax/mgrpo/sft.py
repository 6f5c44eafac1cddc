"""Supervised warm start on the scripted experts' traces (tiny models cannot start from RL).

The experts act through the real rollout engine and tools, so the traces are token sequences
exactly like the RL rollouts: the loss covers only the tokens the agent "generated". The loss
is the token-mean negative log-likelihood, i.e. the REINFORCE objective with advantage 1,
so SFT reuses the RL train step (`trainable.nll_objective`, shared with MAGRPO's warm
start). The final weights are written as HF checkpoints under `workdir/hf/<agent>`, which an
RL config starts from with `init=<workdir>`.
"""

import dataclasses
import re

import jax
import ml_collections
import numpy as np
from absl import logging

from mgrpo_jax import config_checks as checks
from mgrpo_jax import loop, trainable
from mgrpo_jax.mgrpo import play, setup, tasks
from mgrpo_jax.mgrpo import step as mgrpo_step
from mgrpo_jax.envs import search, world
from mgrpo_jax.rl import batch as batch_lib
from mgrpo_jax.rl import rewards

# configs/sft.py's own section (the rest is configs/mgrpo.py's, checked by resolve_wiring).
_RANGES = {"sft.num_questions": checks.at_least(1), "sft.expert_noise": checks.PROBABILITY,
           "sft.context_weight": checks.NONNEGATIVE, "sft.other_roles_weight": checks.NONNEGATIVE,
           "sft.corpus_weight": checks.NONNEGATIVE, "sft.num_steps": checks.at_least(1),
           "sft.batch_size": checks.at_least(1), "sft.learning_rate": checks.POSITIVE,
           "sft.weight_decay": checks.NONNEGATIVE, "sft.eval_every": checks.at_least(1),
           "sft.checkpoint_every": checks.at_least(1),
           "sft.other_worlds": checks.Range(0, tasks.RL_WORLD_BASE - 1, integer=True),
           "sft.visit_drill_weight": checks.NONNEGATIVE,
           "sft.report_weight": checks.POSITIVE}


def expert_episodes(c, w: setup.Wiring, env, *, seed: int, others=()) -> dict[str, list]:
  """Expert traces per agent (format-valid ones only), on `sft.num_questions` questions.

  Without `others` they are the training questions' (cycled). With other worlds
  (`tasks.other_world_env`) the questions are shared evenly between the training split and
  each other world's questions. An other world's trace that names one of
  `env.held_out_names` (two invented worlds can share a word) is dropped.
  """
  sft = c.sft
  # A name seen in a few traces only, among far more names than a tiny model can memorise,
  # is copied from the context rather than recalled: with only the 140 training entities,
  # the warm start wrote a training name that began like the held-out question's.
  sources = [(env, env.train)] + [(o, o.train + o.test) for o in others]
  counts = world.allocate(sft.num_questions, [1.0] * len(sources))
  names = tasks.names_pattern(env.held_out_names)
  keep = lambda es: [e for e in es if e.format_ok and (not sft.only_correct or _correct(e))]
  out = {name: [] for name in w.agents}
  for i, ((source_env, pool), n) in enumerate(zip(sources, counts)):
    if not n:
      continue
    # The training world keeps the seeds it had before other worlds existed.
    policies = play.expert_policies(c, w, source_env, noise=sft.expert_noise, seed=seed + i)
    questions = [pool[j % len(pool)] for j in range(n)]
    key = jax.random.fold_in(jax.random.key(seed), i) if i else jax.random.key(seed)
    eps, sub_eps = play.run_rollouts(c, w, source_env, policies, questions, num_rollouts=1,
                                     key=key, step=0)
    if i and names:
      eps, sub_eps = _without_names(eps, sub_eps, names, env.tokenizer)
    for role, role_eps in zip(w.roles, (eps, sub_eps)):
      out[w.agent_of[role]] += keep(role_eps)  # 'shared': one agent learns both roles.
  return out


def trace_worlds(c) -> int:
  """How many other worlds' questions the experts solve: `sft.trace_worlds`, -1 (and a
  config from before the field) meaning `sft.other_worlds`."""
  n = c.sft.get("trace_worlds", -1)
  return c.sft.other_worlds if n == -1 else n


def check_trace_worlds(c) -> None:
  """Refuses a `sft.trace_worlds` that is not -1 or an integer from `sft.other_worlds` to
  below RL's worlds: every world whose pages the warm start reads asks questions too. A
  config from before the field (a run's config.json) has none: -1."""
  n = c.sft.get("trace_worlds", -1)
  ok = isinstance(n, int) and not isinstance(n, bool) and (
      n == -1 or c.sft.other_worlds <= n < tasks.RL_WORLD_BASE)
  if not ok:
    raise checks.ConfigValueError(
        f"config.sft.trace_worlds={n!r}: expected -1 (the same worlds as "
        f"config.sft.other_worlds={c.sft.other_worlds}) or an integer from other_worlds to "
        f"{tasks.RL_WORLD_BASE - 1}; the worlds whose pages the warm start reads ask "
        "questions too.")


def other_world_questions(c) -> int:
  """How many questions each of the other worlds asks (its share of `sft.num_questions`,
  the training split taking one share too)."""
  return -(-c.sft.num_questions // (trace_worlds(c) + 1))


def other_world_envs(c) -> list:
  """The other worlds' tasks (`trace_worlds`), each with its share of `sft.num_questions`;
  the first `sft.other_worlds` of them give their pages to `corpus_rows` too."""
  check_trace_worlds(c)
  k, per_world = trace_worlds(c), other_world_questions(c)
  if k:
    logging.info("sft: the traces are shared by the training split and %d other worlds "
                 "(%d questions each); the pages of %d of them are corpus rows.", k, per_world,
                 c.sft.other_worlds)
  return [tasks.other_world_env(c, i, per_world) for i in range(k)]


def objective_config(c: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """`c` with the warm start's objective: the token-mean NLL at `sft.learning_rate`, sampling
  at temperature 1 (the agents' states, checkpoints included, are built from it)."""
  out = c.copy_and_resolve_references()
  for role in ("main", "sub"):
    out[f"{role}_loss"], out[f"{role}_optim"] = trainable.nll_objective(
        c[f"{role}_loss"], c[f"{role}_optim"], learning_rate=c.sft.learning_rate,
        weight_decay=c.sft.weight_decay)
  out.sampling.temperature = 1.0
  return out


def _without_names(eps, sub_eps, names: re.Pattern, tokenizer) -> tuple[list, list]:
  """Drops the questions (main and sub episodes together) whose text matches `names`."""
  bad = {e.q for e in list(eps) + list(sub_eps) if names.search(tokenizer.decode(e.tokens))}
  if bad:
    logging.info("sft: dropped %d other-world questions naming a held-out entity.", len(bad))
  return [e for e in eps if e.q not in bad], [e for e in sub_eps if e.q not in bad]


@dataclasses.dataclass(frozen=True)
class TextRow:
  """A row of text to model: its tokens and per-token loss weights (default: every token 1,
  as for a page of the world's corpus)."""

  tokens: np.ndarray
  weights: np.ndarray | None = None

  @property
  def loss_mask(self) -> np.ndarray:
    return np.ones(len(self.tokens), np.float32) if self.weights is None else self.weights

  @property
  def logprobs(self) -> np.ndarray:
    return np.zeros(len(self.tokens), np.float32)


def corpus_rows(env, others=()) -> list[TextRow]:
  """Every training page as the tools show it, and every page of the other worlds (those
  naming none of `env.held_out_names`): pretraining text for the warm start.

  A row is the search reply for the page's title, then the page as the visit tool shows it.
  The page repeats its subject and the hit's doc id and title, which are copied from earlier
  in the row, as the agents must copy them (a doc id seen only where it cannot be predicted
  would be trained only towards the prior of all doc ids).
  """
  names = tasks.names_pattern(env.held_out_names)
  rows = []
  for i, source in enumerate([env, *others]):
    for d in source.documents:
      hits = search.format_hits(source.index.search(d.title, k=1))
      text = f"{hits}\n[{d.doc_id}] {d.title}\n{d.text}"
      if i and names and names.search(text):
        continue
      rows.append(TextRow(np.asarray(env.tokenizer.encode(text), np.int32)))
  return rows


def _generated_turns(e, tokenizer):
  """(start, end, text) of each of `e`'s generated turns (a run of loss-mask entries > 0)."""
  on = (np.asarray(e.loss_mask, np.float32) > 0).astype(np.int8)
  edges = np.flatnonzero(np.diff(np.concatenate([[0], on, [0]])))
  for start, end in zip(edges[::2], edges[1::2]):
    yield int(start), int(end), tokenizer.decode(e.tokens[start:end]).lstrip()


def visit_drills(eps, tokenizer, weight: float) -> list[TextRow]:
  """One drill per episode that visits a page: its tokens up to the end of its first
  generated turn that starts with `<visit>`, with loss weight `weight` on that turn only.

  The drills are the same traces, so they add no information, only weight on that choice.
  """
  out = []
  for e in eps:
    for start, end, text in _generated_turns(e, tokenizer):
      # Choosing the hit whose title is the searched name and copying its doc id is one
      # token of a ~500-token episode whose other tokens the model learns long before: after
      # 1100 warm-start steps the sub-agent's probability of the right id was chance, while a
      # model of the same size trained on these cut episodes alone learnt it.
      if text.startswith("<visit>"):
        drill = np.zeros(end, np.float32)
        drill[start:end] = weight
        out.append(TextRow(np.asarray(e.tokens[:end], np.int32), drill))
        break
  return out


REPORT_TAGS = ("<result>", "<answer>")


def weigh_reports(eps, tokenizer, weight: float) -> list:
  """`eps` with loss weight `weight` on their generated turns that start with one of
  REPORT_TAGS: a sub-agent's result, copied from the page it read, and an answer.

  The episodes are copies; the tokens are unchanged.
  """
  out = []
  for e in eps:
    mask = np.asarray(e.loss_mask, np.float32).copy()
    for start, end, text in _generated_turns(e, tokenizer):
      # Like the choice of page (`visit_drills`), copying the value from the page is a few
      # tokens of a ~500-token trace: at step 900 the sub-agent visited the right page for
      # 40% of its calls, and reported another value of the same kind ("Kraevein Guild" for
      # "Kraevein Institute").
      if text.startswith(REPORT_TAGS):
        mask[start:end] *= weight
    out.append(dataclasses.replace(e, loss_mask=mask))
  return out


def _correct(ep) -> bool:
  if ep.role == "sub":
    return True  # A sub-agent trace is judged by the main episode it served.
  return bool(rewards.exact_match(ep.final or "", ep.task.answers))


def _pick(eps: list, n: int, rng: np.random.Generator) -> list:
  return [eps[i] for i in rng.choice(len(eps), n, replace=len(eps) < n)]


def _weights(mask_BxT: np.ndarray, rows, row_weights, context_weight: float) -> np.ndarray:
  """Per-token loss weights (the loss mask is a weight in the token-mean NLL).

  An agent's own rows: generated tokens 1, every other token `context_weight`. Prompts and
  tool replies repeat each name several times (a page names its entity in every sentence),
  so modelling them teaches a tiny model to copy names from its context far sooner than the
  few generated tokens do. Rows of another role's traces (weight w, not None): every token
  w, as text to model, not as actions of this agent; the main agent's own traces name an
  entity only once before copying it, so it learns copying from the sub-agent's pages.
  """
  lengths_B = np.asarray([len(e.tokens) for e in rows])
  inside_BxT = np.arange(mask_BxT.shape[1])[None, :] < lengths_B[:, None]
  own = np.where(mask_BxT > 0, mask_BxT, np.where(inside_BxT, context_weight, 0.0))
  other_B = np.asarray([-1.0 if w is None else w for w in row_weights])
  other = np.where(inside_BxT, other_B[:, None], 0.0)
  return np.where(other_B[:, None] < 0, own, other).astype(np.float32)


def warm_start_texts(c, w: setup.Wiring, env) -> tuple[dict[str, list], list[TextRow]]:
  """The warm start's material: the experts' traces per agent (`expert_episodes` over the
  training split and `trace_worlds` other worlds) and, with `sft.corpus_weight`, the pages
  of the training split and of the first `sft.other_worlds` other worlds (`corpus_rows`)."""
  logging.info("sft: the scripted experts solve %d training questions (the warm start's "
               "traces).", c.sft.num_questions)
  others = other_world_envs(c)
  data = expert_episodes(c, w, env, seed=c.seed, others=others)
  corpus = corpus_rows(env, others[:c.sft.other_worlds]) if c.sft.corpus_weight else []
  return data, corpus


def _check(c) -> None:
  """configs/sft.py's own section (the rest is configs/mgrpo.py's, checked with the wiring)."""
  checks.check_config(c, {}, _RANGES)
  check_trace_worlds(c)


def train_sft(c: ml_collections.ConfigDict, workdir: str) -> dict:
  """Runs the warm start; resumes from `workdir` when it holds a checkpoint."""
  sft = c.sft
  # The agents learn with the warm start's objective; one checkpoint is enough to resume.
  p = setup.start(c, workdir, training=False, check=_check,
                  batch_rows={"sft.batch_size": sft.batch_size}, agent_config=objective_config,
                  agent_key=jax.random.key(c.seed), max_to_keep=1)
  env, agents = p.env, p.agents
  data, corpus = warm_start_texts(c, p.wiring, env)
  drills = {name: visit_drills(eps, env.tokenizer, sft.visit_drill_weight)
            if sft.visit_drill_weight else [] for name, eps in data.items()}
  if sft.report_weight != 1:
    data = {name: weigh_reports(eps, env.tokenizer, sft.report_weight)
            for name, eps in data.items()}
  # Per agent, the other roles' traces (built once: the list is as long as the data).
  others = {name: [e for other, eps in data.items() if other != name for e in eps]
            for name in data}
  for name, eps in data.items():
    lens = [len(e.tokens) for e in eps]
    logging.info("SFT data %s: %d episodes, %d-%d tokens, %d visit drills.", name, len(eps),
                 min(lens), max(lens), len(drills[name]))

  # An agent that plays several roles ('shared') gets batch_size rows of each role per step,
  # as the pair's agents do: drawn from its mixed list, it got about one main row in four.
  by_role = {name: [[e for e in eps if e.role == role] for role in dict.fromkeys(
      e.role for e in eps)] for name, eps in data.items()}

  def batch_of(name: str, step: int) -> batch_lib.Batch:
    rng = np.random.default_rng([c.seed, step, len(name)])
    rows = [e for eps in by_role[name] for e in _pick(eps, sft.batch_size, rng)]
    if drills[name]:
      rows += _pick(drills[name], sft.batch_size, rng)
    weights = [None] * len(rows)
    for extra_rows, weight in ((others[name], sft.other_roles_weight),
                               (corpus, sft.corpus_weight)):
      if weight and extra_rows:
        extra = _pick(extra_rows, sft.batch_size // 2, rng)
        rows, weights = rows + extra, weights + [weight] * len(extra)
    batch = batch_lib.make_batch(rows, np.ones(len(rows), np.float32), max_len=c.limits.max_len,
                                 pad_id=env.tokenizer.pad_id, minimum=mgrpo_step.MIN_LENGTH)
    batch = batch.replace(version=None)  # Demonstrations: no behaviour policy to lag.
    if sft.context_weight or sft.other_roles_weight or sft.corpus_weight:
      batch = batch.replace(loss_mask=_weights(batch.loss_mask, rows, weights,
                                               sft.context_weight))
    return batch

  def learn(step: int, _) -> tuple[dict, dict]:
    return {n: batch_of(n, step) for n in agents}, {}

  def train(batches: dict, step: int) -> dict:
    out = trainable.update_agents(agents, batches, step)
    return {f"sft/{n}/{k}": out[f"{n}/{m}"] for n in agents
            for k, m in (("nll", "loss"), ("grad_norm", "grad_norm"))}

  def evaluate(step: int) -> dict:
    return play.evaluate(c, p.wiring, env, agents, step=step,
                         questions_file=play.questions_path(workdir, step))

  return p.run(workdir, rollout=None, learn=learn, train=train, evaluate=evaluate, desc="sft",
               show=[f"sft/{n}/nll" for n in agents] + ["eval/accuracy"],
               schedule=loop.Schedule(sft.num_steps, sft.eval_every, sft.checkpoint_every,
                                      c.log_every))
