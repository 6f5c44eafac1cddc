"""The deep-research task of M-GRPO and its warm start, built from a config.

The offline world (`envs.world`; `world.kind="multihop"`: long pages asked the bridge and
comparison questions of `envs.multihop`), its train/test question split, the search/visit/python
tools over the configured retriever (`envs.retrieval`; by default the world's documents) and
the tokenizer, whose words may come from the world (`tokenizer_words`). A config with a
`data` block (configs/mgrpo.py:task=qa) is real QA data instead (`build_qa_env`).
"""

import dataclasses
import os

import ml_collections

from mgrpo_jax import config_checks as checks
from mgrpo_jax import tokenizer as tk
from mgrpo_jax.agents import protocol
from mgrpo_jax.envs import datasets, multihop, python_tool, qa, retrieval, search, world


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
  tokenizer = tk.load_tokenizer(spec, words=tokenizer_words(spec, the_world))
  return Env(tokenizer, train, test, index, tools, documents, valid, held_out)


# Another world's seed is the task's plus a multiple of this (other_world_env).
OTHER_WORLD_SEED_STRIDE = 1_000


def other_world_env(c: ml_collections.ConfigDict, k: int, num_questions: int) -> Env:
  """The task on its k-th other world (k >= 0): the same config with another world seed, no
  held-out parts and `num_questions` questions (train and test together), so other
  entities, names and pages, all of them training material for the warm start
  (`sft.other_worlds`): no question or page of `build_env(c)` is among them."""
  if is_qa(c):
    raise checks.ConfigValueError("config.sft.other_worlds needs a generated world "
                                  "(task=multihop or the default world); task=qa has none.")
  other = c.copy_and_resolve_references()
  other.world.seed = c.world.seed + OTHER_WORLD_SEED_STRIDE * (k + 1)
  other.world.update(holdout=(0.0, 0.0), num_questions=num_questions)
  return build_env(other)


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
  load = lambda path: datasets.load_qa(path, d.format, fields=dict(d.fields)) if path else []
  train, test = load(d.train), load(d.eval)
  index, documents = qa.make_retriever(d.corpus, c.retrieval, train + test)
  tools = dict(search.local_tools(index, k=c.world.search_k, max_chars=c.world.visit_chars),
               python=python_tool.PythonTool())
  return Env(tk.load_tokenizer(tokenizer_spec(c)), train, test, index, tools, documents)


def tokenizer_spec(c) -> str:
  """The tokenizer `config.tokenizer` means: "" is the checkpoint's own, that of
  `main_model.hf_path`, else of the warm start's export (`<init>/hf/main`) when it carries
  tokenizer files, else the byte tokenizer."""
  checkpoint = c.main_model.hf_path
  if not checkpoint and c.init and tk.has_tokenizer_files(os.path.join(c.init, "hf", "main")):
    checkpoint = os.path.join(c.init, "hf", "main")
  return tk.resolve_spec(c.tokenizer, checkpoint)


def tokenizer_words(spec: str, the_world: world.World) -> tuple[str, ...]:
  """The plain-text words a byte tokenizer gives one id each (see `tk.load_tokenizer`).

  "byte+names": the world's names, doc ids and question stems. "byte+world": those, the page
  templates' phrases, the chat role lines and the protocol's prompt openings: what a
  tokenizer trained on the world's traces would make single tokens. "byte+phrases": those
  without the names, which are spelled in bytes: a name that only held-out questions use
  (task=multihop's held-out chains) then has no id of its own that training never showed,
  and copying it is the same skill as copying a training name. "byte+phrases+ids": those
  and the doc ids, the tools' opaque handles for pages ("doc059"): every world of the same
  size has the same ids, so the warm start's other worlds (`sft.other_worlds`) train the ids
  of the held-out pages too.
  """
  if spec in ("byte+world", "byte+phrases", "byte+phrases+ids"):
    words = (world.vocabulary(the_world, phrases=True, names=spec == "byte+world")
             + tk.ROLE_WORDS + protocol.PROMPT_WORDS)
    if spec == "byte+phrases+ids":
      words += tuple(sorted(d.doc_id for d in the_world.documents))
    return tuple(dict.fromkeys(words))
  return world.vocabulary(the_world) if spec == "byte+names" else ()


def eval_questions(c, env: Env) -> list:
  """The held-out questions an evaluation answers: `c.eval_split`'s ("valid" while tuning)."""
  return getattr(env, c.get("eval_split", "test"))[:c.num_eval_questions]
