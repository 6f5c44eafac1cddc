"""The deep-research task of M-GRPO and its warm start, built from a config.

The offline world (`envs.world`; `world.kind="multihop"`: long pages asked the bridge and
comparison questions of `envs.multihop`), its train/test question split, the search/visit/python
tools over the configured retriever (`envs.retrieval`; by default the world's documents) and
the tokenizer, whose words may come from the world (`tokenizer_words`). A config with a
`data` block (configs/mgrpo.py:task=qa) is real QA data instead (`build_qa_env`).
"""

import dataclasses
import os
import re

import ml_collections

from mgrpo_jax import config_checks as checks
from mgrpo_jax import chat_format, hf_tokenizer, keys, tokenizer_io
from mgrpo_jax import tokenizer as tk
from mgrpo_jax.agents import native, prompts
from mgrpo_jax.envs import multihop, python_tool, qa, retrieval, search, tool_health, world


@dataclasses.dataclass
class Env:
  """The task: tokenizer, world, question splits, the retriever behind the tools, the tools."""

  tokenizer: tk.Tokenizer
  train: list
  test: list
  index: search.Retriever
  tools: dict
  documents: tuple = ()  # The world's pages (the SFT corpus), whatever `index` searches.
  valid: list = dataclasses.field(default_factory=list)  # Tuning questions (world.holdout).
  held_out_names: tuple = ()  # Names of the validation and test parts' entities.


def build_env(c: ml_collections.ConfigDict) -> Env:
  """The offline research world with its train/test split and tools (or the QA data's)."""
  tool_health.configure(c)  # A new run's tool counts and retry policy (config.tools).
  if is_qa(c):
    return build_qa_env(c)
  w = c.world
  wcfg = world_config(c)
  the_world = world.generate_world(wcfg)
  if w.kind == "multihop":
    questions = multihop.make_questions(the_world, num=w.num_questions,
                                        hop_weights=tuple(w.hop_weights),
                                        compare_fraction=w.compare_fraction, seed=w.seed,
                                        min_answer_space=w.min_answer_space)
  else:
    questions = world.make_questions(the_world, num=w.num_questions,
                                     hop_weights=tuple(w.hop_weights), seed=w.seed)
  documents, valid, held_out = the_world.documents, [], ()
  if sum(w.holdout) > 0:
    # Split by whole chains; the warm start's corpus is the training pages only.
    parts = world.split_by_part(the_world, questions)
    train, valid, test = parts["train"], parts["valid"], parts["test"]
    documents = world.part_documents(the_world, "train")
    held_out = tuple(e.name for e in the_world.entities if e.part != "train")
  else:
    train, test = world.split_questions(questions, w.test_fraction, seed=w.seed)
  index = retrieval.make_retriever(c.retrieval, the_world.documents)
  tools = dict(search.local_tools(index, k=w.search_k, max_chars=w.visit_chars,
                                  shuffle=w.shuffle_hits),
               python=python_tool.PythonTool())
  spec = tokenizer_spec(c)
  tokenizer = tokenizer_io.load_tokenizer(
      spec, words=tokenizer_words(spec, the_world, c.get("protocol", "tags")))
  return Env(tokenizer, train, test, index, tools, documents, valid, held_out)


# Another world's seed is the task's plus a multiple of this (other_world_env).
OTHER_WORLD_SEED_STRIDE = 1_000


def other_world_env(c: ml_collections.ConfigDict, k: int, num_questions: int, *,
                    field: str = "sft.other_worlds") -> Env:
  """The task on its k-th other world (k >= 0): the same config with another world seed, no
  held-out parts and `num_questions` questions (train and test together), so other
  entities, names and pages, all of them training material (the warm start's
  `sft.other_worlds`, RL's `rl_worlds`): no question or page of `build_env(c)` is among them.
  `field`: the config field that asked for other worlds, named when the task has none."""
  check_other_worlds(c, field)
  other = c.copy_and_resolve_references()
  other.world.seed = c.world.seed + OTHER_WORLD_SEED_STRIDE * (k + 1)
  other.world.update(holdout=(0.0, 0.0), num_questions=num_questions)
  return build_env(other)


def check_other_worlds(c: ml_collections.ConfigDict, field: str) -> None:
  """Refuses other worlds (asked for by `config.<field>`) where the task cannot build them:
  task=qa has no generated world, and a fixed corpus or server would not serve their pages."""
  if is_qa(c):
    raise checks.ConfigValueError(f"config.{field} needs a generated world "
                                  "(task=multihop or the default world); task=qa has none.")
  if c.retrieval.backend != "bm25s" or c.retrieval.corpus:
    raise checks.ConfigValueError(
        f"config.{field} needs the tools to search each world's own pages "
        "(config.retrieval.backend='bm25s' with corpus=''); got "
        f"backend={c.retrieval.backend!r}, corpus={c.retrieval.corpus!r}, which serve one "
        "fixed corpus.")


# RL's worlds (config.rl_worlds) are other worlds from this index on, past every warm start's
# (sft.other_worlds counts from 0), so RL never asks a question of a world the warm start read.
RL_WORLD_BASE = 10_000
# Questions generated per RL world: more than a step draws, fewer than a CPU world can give.
RL_WORLD_QUESTIONS = 256


# Tokenizers with one id per name of the task's world: another world's names would be spelled
# in bytes in RL and read as one id each in evaluation.
_NAMES_IN_VOCABULARY = ("byte+names", "byte+world")


def check_rl_worlds(c: ml_collections.ConfigDict) -> None:
  """Refuses, naming the field, RL worlds (`rl_worlds`, `rl_hop_weights`) the task cannot
  serve: before any model is built (`setup.resolve_wiring`). A config from before the
  fields (a run's config.json) has neither: 0 and ()."""
  n, weights = c.get("rl_worlds", 0), tuple(c.get("rl_hop_weights", ()))
  if n not in checks.at_least(0):
    raise checks.ConfigValueError(f"config.rl_worlds={n!r}; expected {checks.at_least(0)}.")
  if weights and not n:
    raise checks.ConfigValueError(
        f"config.rl_hop_weights={weights} weighs the RL worlds' questions, but "
        "config.rl_worlds=0 trains on the task's own split: set rl_worlds > 0 or leave "
        "rl_hop_weights=().")
  if not n:
    return
  check_other_worlds(c, f"rl_worlds={n}")
  if c.tokenizer in _NAMES_IN_VOCABULARY:
    raise checks.ConfigValueError(
        f"config.rl_worlds={n} with config.tokenizer={c.tokenizer!r}: that vocabulary gives "
        "the task's names one id each, so other worlds' names would be spelled differently "
        "in training and evaluation; use 'byte+phrases' or 'byte+phrases+ids'.")
  if weights:
    if len(weights) != len(c.world.hop_weights):
      raise checks.ConfigValueError(
          f"config.rl_hop_weights={weights}: one weight per chain length of "
          f"config.world.hop_weights={tuple(c.world.hop_weights)} "
          f"({len(c.world.hop_weights)} weights).")
    checks.check_weights(c, "rl_hop_weights")


class TrainingQuestions:
  """Each RL step's questions and the task that answers them (its tools, its pages).

  `config.rl_worlds = 0`: the training split, a fresh permutation each epoch
  (`keys.examples_for_step`). `rl_worlds = N > 0`: step s asks the questions of generated
  world s mod N (`rl_world_env`), none of them the task's or the warm start's. Both are
  deterministic in (seed, step): a resumed run asks the same.
  """

  # RL worlds kept built: a few worlds cycled are built once; a fresh one per step is not kept.
  CACHED_WORLDS = 8

  def __init__(self, c: ml_collections.ConfigDict, env: Env):
    self._c, self._env, self._worlds = c, env, {}

  def __call__(self, step: int) -> tuple[Env, list]:
    c, n = self._c, self._c.get("rl_worlds", 0)
    if not n:
      return self._env, keys.examples_for_step(self._env.train, step, c.num_queries, c.seed)
    # A world no warm start read: on a world the agents had read, RL rewarded recall of its
    # chains, which held-out chains do not share (23% -> 36% on the training questions in
    # 90 steps, validation flat).
    k = step % n
    if k not in self._worlds:
      if len(self._worlds) >= self.CACHED_WORLDS:
        self._worlds.pop(next(iter(self._worlds)))  # The oldest.
      self._worlds[k] = rl_world_env(c, k, self._env)
    env = self._worlds[k]
    return env, keys.examples_for_step(env.train, step // n, c.num_queries, c.seed)


def rl_world_env(c: ml_collections.ConfigDict, k: int, env: Env) -> Env:
  """RL's k-th world (`TrainingQuestions`): `RL_WORLD_QUESTIONS` questions of a world no
  warm start used, read with `env`'s tokenizer (the agents' vocabulary), every question
  for training, in `config.rl_hop_weights`' mix of chain lengths (the task's if empty).
  A question whose chain or pages name one of `env.held_out_names` (two invented worlds can
  share a word) is dropped: no held-out name is in an RL question or on its chain's pages
  (a search may still show another page's title)."""
  if c.get("rl_hop_weights"):  # RL's own mix of chain lengths (a curriculum).
    c = c.copy_and_resolve_references()
    c.world.hop_weights = tuple(c.rl_hop_weights)
  other = other_world_env(c, RL_WORLD_BASE + k, RL_WORLD_QUESTIONS, field="rl_worlds")
  names = names_pattern(env.held_out_names)
  pages = {d.doc_id: f"{d.title} {d.text}" for d in other.documents}
  mentions = lambda q: " ".join([q.text, q.answer, *q.aliases] + [
      f"{h.entity} {h.answer} {pages[h.doc_id]}" for h in q.hops])
  train = [q for q in other.train + other.test if not (names and names.search(mentions(q)))]
  return dataclasses.replace(other, tokenizer=env.tokenizer, train=train, test=[], valid=[],
                             held_out_names=())


def names_pattern(names) -> re.Pattern | None:
  """Matches any of `names` as whole words (None for no names)."""
  if not names:
    return None
  return re.compile(r"\b(?:" + "|".join(re.escape(n) for n in sorted(names, key=len)[::-1])
                    + r")\b")


def world_config(c: ml_collections.ConfigDict) -> world.WorldConfig:
  """The generated world of `c.world`."""
  w = c.world
  return world.WorldConfig(seed=w.seed, num_people=w.num_people, num_orgs=w.num_orgs,
                           num_places=w.num_places, num_works=w.num_works,
                           num_countries=w.num_countries, num_rivers=w.num_rivers,
                           distractors_per_doc=w.distractors_per_doc,
                           name_similarity=w.name_similarity,
                           filler_sentences=tuple(w.filler_sentences),
                           holdout=tuple(w.holdout))


def is_qa(c) -> bool:
  """Whether the config is task=qa (it has a `data` block)."""
  return "data" in c


def build_qa_env(c: ml_collections.ConfigDict) -> Env:
  """Real multi-hop QA: `data.train` / `data.eval` questions, tools over `data.corpus`."""
  checks.check_qa_data(c)
  d = c.data
  train, test, index, documents = qa.load_data(d, c.retrieval)  # Every record checked.
  tools = dict(search.local_tools(index, k=c.world.search_k, max_chars=c.world.visit_chars),
               python=python_tool.PythonTool())
  spec = tokenizer_spec(c)
  tokenizer = tokenizer_io.load_tokenizer(
      spec, words=tokenizer_words(spec, None, c.get("protocol", "tags")))
  return Env(tokenizer, train, test, index, tools, documents)


def tokenizer_spec(c) -> str:
  """The tokenizer `config.tokenizer` means: "" is the checkpoint's own, that of
  `main_model.hf_path`, else of the warm start's export (`<init>/hf/main`) when it carries
  tokenizer files, else the byte tokenizer."""
  checkpoint = c.main_model.hf_path
  export = os.path.join(c.init, "hf", "main") if c.init else ""
  if not checkpoint and export and hf_tokenizer.has_tokenizer_files(export):
    checkpoint = export
  return tokenizer_io.resolve_spec(c.tokenizer, checkpoint)


def tokenizer_words(spec: str, the_world: world.World | None,
                    protocol: str = "tags") -> tuple[str, ...]:
  """The plain-text words a byte tokenizer gives one id each (see `tokenizer_io.load_tokenizer`).

  "byte+names": the world's names, doc ids and question stems. "byte+world": those, the page
  templates' phrases, the chat role lines and the protocol's prompt openings: what a
  tokenizer trained on the world's traces would make single tokens. "byte+phrases": those
  without the names, which are spelled in bytes: a name that only held-out questions use
  (task=multihop's held-out chains) then has no id of its own that training never showed,
  and copying it is the same skill as copying a training name. "byte+phrases+ids": those
  and the doc ids, the tools' opaque handles for pages ("doc059"): every world of the same
  size has the same ids, so the warm start's other worlds (`sft.other_worlds`) train the ids
  of the held-out pages too. "byte": none (`the_world` may be None: task=qa has no world).

  `protocol="native"` adds, to every byte spec, the native protocol's fixed strings
  (`native.vocabulary`: each role's tool declarations, the calls' JSON around their
  values), as the tags are one id each in both protocols: the tools' schemas would
  otherwise cost ~900-1100 ids of every prompt. A tags run's words do not change.
  """
  if spec == "byte":
    words = ()
  elif spec in ("byte+world", "byte+phrases", "byte+phrases+ids"):
    words = (world.vocabulary(the_world, phrases=True, names=spec == "byte+world")
             + chat_format.ROLE_WORDS + prompts.PROMPT_WORDS)
    if spec == "byte+phrases+ids":
      words += tuple(sorted(d.doc_id for d in the_world.documents))
  elif spec == "byte+names":
    words = world.vocabulary(the_world)
  else:
    return ()  # A checkpoint's tokenizer: its own tokens.
  if protocol == "native":
    words += native.vocabulary()
  return tuple(dict.fromkeys(words))


def eval_questions(c, env: Env) -> list:
  """The held-out questions an evaluation answers: `c.eval_split`'s ("valid" while tuning)."""
  return getattr(env, c.get("eval_split", "test"))[:c.num_eval_questions]
