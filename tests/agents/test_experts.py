"""Tests for the scripted experts: parsers, noise-free accuracy through the real tools, format."""

import collections
import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mgrpo_jax.agents import experts as ex
from mgrpo_jax.agents import validator
from mgrpo_jax.agents import protocol as pr
from mgrpo_jax.envs import world as wd
from mgrpo_jax.envs.retrieval import Bm25Retriever
from mgrpo_jax.envs.search import format_hits, local_tools
from mgrpo_jax.rl.rewards import exact_match

_CONFIGS = {
  "plain": wd.WorldConfig(seed=2, distractors_per_doc=3),
  # Look-alike names and more distractors: search hits that merely mention the entity.
  "lookalike": wd.WorldConfig(seed=5, distractors_per_doc=5, name_similarity=0.5),
}


@pytest.fixture(scope="module", params=sorted(_CONFIGS))
def setting(request):
  world = wd.generate_world(_CONFIGS[request.param])
  questions = wd.make_questions(world, num=150, seed=1)  # 50 per hop count
  return world, Bm25Retriever.from_documents(world.documents), questions


def _accuracy_by_hops(questions, results):
  by_hops = collections.defaultdict(list)
  for q, r in zip(questions, results):
    by_hops[len(q.hops)].append(exact_match(r["answer"] or "", q.answer))
  return {h: float(np.mean(v)) for h, v in sorted(by_hops.items())}


def _check_format(result, max_turns=20):
  """Every turn parses for its role and every episode is r_format-valid."""
  for text in result["main_turns"]:
    assert pr.parse_turn(text, "main").ok, text
  assert validator.format_ok(result["main_turns"], "main", max_turns)
  for turns in result["sub_episodes"]:
    assert all(pr.parse_turn(t, "sub").ok for t in turns), turns
    assert validator.format_ok(turns, "sub", max_turns)
  assert result["main_format_ok"] and all(result["sub_format_ok"])


# ----------------------------------------------------------------------------------- parsers

# Hand-written, not built from world.py, so the parser is checked against independent text.
_HAND_QUESTIONS = [
  ("In what year was Ana Ruiz born?", ("Ana Ruiz", "birth_year")),
  ("Where was Ana Ruiz born?", ("Ana Ruiz", "birthplace")),
  ("What was the occupation of Ana Ruiz?", ("Ana Ruiz", "occupation")),
  ("Which organisation employed Ana Ruiz?", ("Ana Ruiz", "employer")),
  ("In what year was Brae Press founded?", ("Brae Press", "founded")),
  ("Who founded Brae Press?", ("Brae Press", "founder")),
  ("Where is Brae Press headquartered?", ("Brae Press", "headquarters")),
  ("In which country is Lisvo?", ("Lisvo", "country")),
  ("On which river does Lisvo lie?", ("Lisvo", "river")),
  ("What size of settlement is Lisvo?", ("Lisvo", "population")),
  ("What kind of work is The Kora Tides?", ("The Kora Tides", "medium")),
  ("In what year was The Kora Tides first released?", ("The Kora Tides", "year")),
  ("Who directed The Kora Tides?", ("The Kora Tides", "creator")),
  ("Which organisation published The Kora Tides?", ("The Kora Tides", "publisher")),
  ("  Who   wrote The Kora Tides? ", ("The Kora Tides", "creator")),  # whitespace is loose
]


@pytest.mark.parametrize("text, expected", _HAND_QUESTIONS)
def test_parse_subquestion_hand_written(text, expected):
  assert ex.parse_subquestion(text) == expected


_NOT_QUESTIONS = ["", "Find out about Ana Ruiz.", "Where was born?", "Who founded Brae Press",
                  "Who sang The Kora Tides?"]  # fmt: skip


@pytest.mark.parametrize("text", _NOT_QUESTIONS)
def test_parse_subquestion_rejects_other_text(text):
  assert ex.parse_subquestion(text) is None


@pytest.mark.parametrize("attr", sorted(wd.ASK))
def test_parse_subquestion_covers_every_world_template(attr):
  # Every attribute's template, with every medium's verbs for the work attributes.
  for medium in sorted(wd.MEDIA):
    for name in ("Ana Ruiz", "The Kora Tides", "Lisvo", "Who Where Born"):
      text = wd.ASK[attr].format(np=name, **wd._medium_words(medium))
      assert ex.parse_subquestion(text) == (name, attr), text


_NAMES = st.lists(st.from_regex(r"[A-Z][a-z]{1,9}", fullmatch=True), min_size=1, max_size=3)


@settings(max_examples=25, deadline=None)
@given(words=_NAMES, attr=st.sampled_from(sorted(wd.ASK)))
def test_parse_subquestion_takes_any_name(words, attr):
  name = " ".join(words)
  text = wd.ASK[attr].format(np=name, **wd._medium_words("book"))
  assert ex.parse_subquestion(text) == (name, attr)


def test_parse_subquestion_on_generated_hops(setting):
  _, _, questions = setting
  hops = [h for q in questions for h in q.hops]
  assert {h.attribute for h in hops} >= {"birthplace", "founder", "creator", "publisher"}
  for hop in hops:
    assert ex.parse_subquestion(hop.question) == (hop.entity, hop.attribute)


def test_hop_template_substitutes_a_new_entity():
  hop = wd.Hop("Ana Ruiz", "birthplace", "Lisvo", "doc001", "Where was Ana Ruiz born?")
  template, entity = ex.hop_template(hop)
  assert (template, entity) == ("Where was {entity} born?", "Ana Ruiz")
  assert ex.fill_template(template, "Bo {x} Li") == "Where was Bo {x} Li born?"
  with pytest.raises(ValueError, match="not named once"):
    ex.hop_template(wd.Hop("Ana Ruiz", "birthplace", "Lisvo", "doc001", "Where was Ana born?"))


def test_extract_facts_recovers_every_entity_attribute(setting):
  # Every document states each attribute of its entity once; the extractor must find exactly
  # those (distractor sentences and a_value articles must not leak in).
  world, _, _ = setting
  for entity in world.entities:
    facts = ex.extract_facts(world.document(entity.doc_id).text, entity.name)
    assert {a: v for a, v, _ in facts} == dict(entity.attributes)
    assert len(facts) == len(entity.attributes)
  assert ex.extract_facts(world.documents[0].text, "Nobody Here") == []


def test_extract_facts_prefers_the_most_specific_template():
  text = "Ana Ruiz was born in the year 1901. Ana Ruiz was born in Lisvo. The Kora Tides is a " \
         "film by Ana Ruiz. The Kora Tides is an album."  # fmt: skip
  assert [(a, v) for a, v, _ in ex.extract_facts(text, "Ana Ruiz")] == [
    ("birth_year", "1901"), ("birthplace", "Lisvo")]
  assert [(a, v) for a, v, _ in ex.extract_facts(text, "The Kora Tides")] == [
    ("creator", "Ana Ruiz"), ("medium", "album")]


def test_parse_tool_replies(setting):
  world, index, _ = setting
  tools = local_tools(index)
  doc = world.documents[4]
  hits = ex.parse_hits(tools["search"](doc.title))
  assert (doc.doc_id, doc.title) in hits and len(hits) == 3
  assert ex.parse_hits(format_hits([])) == []
  assert ex.parse_visit(tools["visit"](doc.doc_id)) == (doc.doc_id, doc.title, doc.text)
  assert ex.parse_visit(tools["visit"]("doc999")) is None


# ------------------------------------------------------------------------------- end to end


def test_noise_free_experts_answer_through_the_real_tools(setting):
  _, index, questions = setting
  results = [ex.solve(q, index) for q in questions]
  accuracy = _accuracy_by_hops(questions, results)
  assert set(accuracy) == {1, 2, 3}
  assert min(accuracy.values()) >= 0.95, accuracy
  for q, r in zip(questions, results):
    _check_format(r)
    assert r["correct"] == exact_match(r["answer"], q.answer)
    # The noise-free plan: one delegation per hop, each a search, a visit and a result.
    actions = [pr.parse_turn(t, "main").action for t in r["main_turns"]]
    assert actions == ["delegate"] * len(q.hops) + ["answer"]
    assert r["subtasks"][0] == q.hops[0].question
    for turns in r["sub_episodes"]:
      assert [pr.parse_turn(t, "sub").action for t in turns] == ["search", "visit", "result"]


def test_noise_hurts_accuracy_but_never_format(setting):
  _, index, questions = setting
  rng = np.random.default_rng(0)
  noisy = [ex.solve(q, index, main_noise=0.5, sub_noise=0.5, rng=rng, think=i % 2 == 0)
           for i, q in enumerate(questions)]  # fmt: skip
  for r in noisy:
    _check_format(r)
  accuracy = np.mean([r["correct"] for r in noisy])
  assert accuracy < 0.5, accuracy  # noise-free is >= 0.95


@pytest.mark.parametrize("make_rng", [random.Random, np.random.default_rng])
def test_seeded_rng_is_deterministic(setting, make_rng):
  _, index, questions = setting

  def run(seed, noise):
    rng = make_rng(seed)
    return [ex.solve(q, index, main_noise=noise, sub_noise=noise, rng=rng) for q in questions[:30]]

  assert run(3, 0.5) == run(3, 0.5)
  assert run(3, 0.5) != run(4, 0.5)
  assert run(3, 0.0) == run(4, 0.0)  # no noise: the rng is not even drawn from


# ------------------------------------------------------------------------------ single turns


def _three_hop(setting):
  _, _, questions = setting
  return next(q for q in questions if len(q.hops) == 3)


def test_main_expert_plans_from_attributes_and_uses_results(setting):
  q = _three_hop(setting)
  main, rng = ex.MainExpert(), random.Random(0)
  first = pr.parse_turn(main.turn(q, [], rng), "main")
  assert (first.action, first.argument) == ("delegate", q.hops[0].question)
  assert first.think.startswith("Step 1 of 3:")
  # Hop 2 names whatever the sub-agent said, right or wrong; never the world's answer.
  second = pr.parse_turn(main.turn(q, ["Zed Quill"], rng), "main")
  template, _ = ex.hop_template(q.hops[1])
  assert second.argument == ex.fill_template(template, "Zed Quill")
  assert q.hops[0].answer not in second.argument
  last = pr.parse_turn(main.turn(q, ["Ab", "Cd", "Zed Quill"], rng), "main")
  assert (last.action, last.argument) == ("answer", "Zed Quill")


def test_main_expert_retries_once_then_gives_up(setting):
  q = _three_hop(setting)
  main, rng = ex.MainExpert(think=False), random.Random(0)
  retry = pr.parse_turn(main.turn(q, ["X Y", "unknown"], rng), "main")
  assert (retry.action, retry.think) == ("delegate", None)
  assert retry.argument == ex.fill_template(ex.hop_template(q.hops[1])[0], "X Y")
  again = pr.parse_turn(main.turn(q, ["X Y", ex.NO_RESULT, "Z"], rng), "main")
  assert again.argument == ex.fill_template(ex.hop_template(q.hops[2])[0], "Z")
  assert main.turn(q, ["X Y", "Unknown.", ex.NO_RESULT], rng) == "<answer>unknown</answer>"
  # The engine refuses a delegation past its limit: answer with what there is.
  refused = "Delegation limit reached; give your final answer."
  assert main.turn(q, ["X Y", refused], rng) == "<answer>X Y</answer>"


def test_main_expert_delegates_a_plain_question_whole():
  main, rng = ex.MainExpert(think=False), random.Random(0)
  assert main.turn("Who wrote GAIA?", [], rng) == "<delegate>Who wrote GAIA?</delegate>"
  assert main.turn("Who wrote GAIA?", ["Mialon"], rng) == "<answer>Mialon</answer>"


def test_sub_expert_fails_softly(setting):
  world, index, _ = setting
  sub, rng = ex.SubExpert(think=False), random.Random(0)
  person = next(e for e in world.entities if e.kind == "person")
  task = f"Where was {person.name} born?"
  assert sub.turn("Tell me a story.", [], rng) == "<result>unknown</result>"
  assert sub.turn(task, [], rng) == f"<search>{person.name}</search>"
  assert sub.turn(task, ["No results found."], rng) == "<result>unknown</result>"
  assert sub.turn(task, ["x", "Error: no document 'x'."], rng) == "<result>unknown</result>"
  # The right page, but without the asked attribute (an organisation's page).
  org = next(e for e in world.entities if e.kind == "organisation")
  page = local_tools(index)["visit"](org.doc_id)
  assert sub.turn(f"Where was {org.name} born?", ["x", page], rng) == "<result>unknown</result>"


def test_sub_expert_copies_the_value_from_the_page(setting):
  world, index, _ = setting
  tools, sub, rng = local_tools(index), ex.SubExpert(), random.Random(0)
  work = next(e for e in world.entities if e.kind == "work")
  task = wd.ASK["creator"].format(np=work.name, **wd._medium_words(work.attributes["medium"]))
  search = tools["search"](work.name)
  visit = pr.parse_turn(sub.turn(task, [search], rng), "sub")
  assert (visit.action, visit.argument) == ("visit", work.doc_id)
  result = pr.parse_turn(sub.turn(task, [search, tools["visit"](work.doc_id)], rng), "sub")
  assert (result.action, result.argument) == ("result", work.attributes["creator"])
  assert work.attributes["creator"] in result.think  # the think quotes the fact sentence
