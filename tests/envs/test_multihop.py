"""The multi-hop task: long pages, bridge and comparison questions, experts, the context budget."""

import collections
import hashlib
import json
import re

import pytest

from configs import mgrpo as mgrpo_config
from mgrpo_jax.mgrpo import play, setup, tasks
from mgrpo_jax.agents import experts
from mgrpo_jax.envs import multihop
from mgrpo_jax.envs import world as world_lib
from mgrpo_jax.envs.retrieval import Bm25Retriever

_SENTENCE = re.compile(r"(?<=[.!?])\s+")
# Every slot of the world's templates as a loose pattern (written here, not taken from
# experts.py, so the check is independent of the parser it protects).
_SLOT = {"name": ".+", "value": ".+", "np": ".+", "other": ".+", "year": r"\d+",
         "a_value": "(?:a|an) .+", "a_medium": "(?:a|an) (?:book|album|film)",
         "made": "(?:wrote|recorded|directed)", "issued": "(?:published|released|distributed)"}


def _loose(template: str) -> re.Pattern:
  parts = re.split(r"\{(\w+)\}", template)
  return re.compile("".join(_SLOT[p] if i % 2 else re.escape(p) for i, p in enumerate(parts)))


_FACT_RES = [_loose(t) for ts in world_lib.FACTS.values() for t in ts]
_NOT_FACT_RES = [_loose(t) for t in world_lib._DISTRACTORS + world_lib.FILLER]


@pytest.fixture(scope="module")
def world():
  return world_lib.generate_world(world_lib.WorldConfig(
      seed=3, num_people=30, num_orgs=15, num_places=15, num_works=15, filler_sentences=(2, 4)))


@pytest.fixture(scope="module")
def questions(world):
  return multihop.make_questions(world, num=140, hop_weights=(1, 2, 2, 2), compare_fraction=0.5,
                                 seed=1)


def _digest(env) -> str:
  h = hashlib.sha256()
  for d in env.documents:
    h.update(f"{d.doc_id}|{d.title}|{d.text}\n".encode())
  for q in env.train + env.test:
    h.update(json.dumps([q.id, q.text, q.answer, q.difficulty, list(q.gold_doc_ids),
                         [[x.entity, x.attribute, x.answer, x.doc_id, x.question]
                          for x in q.hops]]).encode())
  h.update(json.dumps(list(env.tokenizer.words)).encode())
  return h.hexdigest()[:16]


@pytest.mark.parametrize("arg, digest", [("runlocal", "fa0038807ba74f61"),
                                         ("", "39fd097979ba1835")])
def test_existing_worlds_are_unchanged(arg, digest):
  """The CPU demo's and the default world's pages, questions and words, as before this task
  existed (digests taken at commit 72dfe3d)."""
  assert _digest(tasks.build_env(mgrpo_config.get_config(arg))) == digest


def test_filler_only_adds_sentences_that_state_no_fact(world):
  base = world_lib.generate_world(world_lib.WorldConfig(
      seed=3, num_people=30, num_orgs=15, num_places=15, num_works=15))
  assert base.entities == world.entities
  for short, long in zip(base.documents, world.documents):
    old, new = _SENTENCE.split(short.text), _SENTENCE.split(long.text)
    assert 2 <= len(new) - len(old) <= 4
    it = iter(new)
    assert all(s in it for s in old)  # The page's own sentences, in their order.
    for s in new:
      if s not in old:
        assert not any(p.fullmatch(s) for p in _FACT_RES), s
        names = [e.name for e in world.entities if e.name in s]
        assert names and long.title not in names, s


def test_no_page_states_a_fact_about_another_entity(world):
  """So no single page can resolve two hops: each entity's facts are on its own page only."""
  for doc in world.documents:
    entity = next(e for e in world.entities if e.doc_id == doc.doc_id)
    facts = experts.extract_facts(doc.text, doc.title)
    assert sorted((a, v) for a, v, _ in facts) == sorted(entity.attributes.items())
    # Every sentence in the shape of a fact is one of the subject's own facts (the world's
    # distractors are not facts, though "Little is recorded about ..." has one's shape).
    shaped = {s for s in _SENTENCE.split(doc.text) if any(p.fullmatch(s) for p in _FACT_RES)
              and not any(p.fullmatch(s) for p in _NOT_FACT_RES)}
    assert shaped == {s for _, _, s in facts}


def test_question_mix_and_comparison_answers(world, questions):
  kinds = collections.Counter((len(q.hops), q.compare) for q in questions)
  assert set(kinds) == {(1, ""), (2, ""), (3, ""), (4, ""), (2, "earlier"), (2, "same"),
                        (4, "earlier"), (4, "same")}
  assert len({q.id for q in questions}) == len(questions)
  for q in questions:
    if not q.compare:
      continue
    side = q.side_hops
    a, b = q.hops[0].entity, q.hops[side].entity
    assert a != b and a in q.text and b in q.text
    va, vb = q.hops[side - 1].answer, q.hops[-1].answer
    # Independent of multihop.compare: recomputed from the world's own attributes.
    ent = world.entity
    if q.compare == "earlier":
      assert q.answer == (a if int(va) < int(vb) else b) and va != vb
    else:
      assert q.answer == ("yes" if va == vb else "no")
    assert va == _walk(ent(a), [h.attribute for h in q.hops[:side]], world)
  same = collections.Counter(q.answer for q in questions if q.compare == "same")
  assert same["yes"] >= 5 and same["no"] >= 5


def _walk(entity, attrs, world):
  for attr in attrs[:-1]:
    entity = world.entity(entity.attributes[attr])
  return entity.attributes[attrs[-1]]


def test_multi_hop_questions_need_several_pages(world, questions):
  """A question needing n pages names n hops over >= 2 entities (facts of two entities are
  never on one page, see above), and no bridge answer is written on its first page."""
  for q in questions:
    if len(q.hops) < 2:
      continue
    assert len({h.doc_id for h in q.hops}) >= 2
    if not q.compare:
      assert q.answer.lower() not in world.document(q.hops[0].doc_id).text.lower()


def test_noise_free_experts_answer_every_question(world, questions):
  index = Bm25Retriever.from_documents(world.documents)
  for q in questions:
    pair = experts.solve(q, index, think=False, search_k=2, max_chars=100_000)
    single = experts.solve_single(q, index, think=False, search_k=2, max_chars=100_000)
    assert pair["correct"] and single["correct"], q
    assert len(pair["subtasks"]) == len(q.hops)  # One delegation per page.
    visits = [o for o in single["observations"] if o.startswith("[doc")]
    visited = {experts.parse_visit(o)[0] for o in visits if experts.parse_visit(o)}
    assert visited == {h.doc_id for h in q.hops}


@pytest.fixture(scope="module")
def cpu_task():
  """The CPU size's task (configs/mgrpo.py:task=multihop,runlocal) and 60 held-out questions."""
  c = mgrpo_config.get_config("task=multihop,runlocal,policy=expert")
  env = tasks.build_env(c)
  return c, env, env.test[:60]


@pytest.mark.parametrize("variant", ["mgrpo", "single"])
def test_context_budget(cpu_task, variant):
  """One max_len for every agent: the main agent with the sub-agent's short answers and each
  sub-agent (one search + one page) fit it; a single agent that pastes raw pages runs out of
  context on every question that needs two pages or more, and fits the one-page ones."""
  c, env, questions = cpu_task
  c = c.copy_and_resolve_references()
  c.variant, c.num_eval_questions = variant, len(questions)
  w = setup.resolve_wiring(c, training=False)
  setup.check_task(c, w, env)
  m = play.evaluate(c, w, env, {}, step=0, questions=questions)
  hops = {len(q.hops) for q in questions}
  assert hops == {1, 2, 3, 4}
  if variant == "mgrpo":
    assert m["eval/accuracy"] == 1.0 and m["eval/overflow"] == 0.0
    assert m["eval/sub_overflow"] == 0.0 and m["eval/sub_format"] == 1.0
  else:
    assert m["eval/accuracy_hops1"] == 1.0 and m["eval/overflow_hops1"] == 0.0
    for n in (2, 3, 4):
      assert m[f"eval/overflow_hops{n}"] == 1.0 and m[f"eval/accuracy_hops{n}"] == 0.0


def test_compare_rule():
  assert multihop.compare("earlier", "1901", "1899", "A", "B") == "B"
  assert multihop.compare("earlier", " 1850", "1900 ", "A", "B") == "A"
  assert multihop.compare("earlier", "1900", "1900", "A", "B") is None
  assert multihop.compare("earlier", "unknown", "1900", "A", "B") is None
  assert multihop.compare("same", "Zedland", "zedland ", "A", "B") == "yes"
  assert multihop.compare("same", "Zedland", "Ostmark", "A", "B") == "no"
  with pytest.raises(ValueError, match="unknown comparison"):
    multihop.compare("later", "1", "2", "A", "B")
