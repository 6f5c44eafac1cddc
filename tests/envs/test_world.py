"""Tests for the offline research world: determinism, documents, question chains, splits."""

import re

import pytest

from mgrpo_jax import byte_tokenizer
from mgrpo_jax.envs import world as world_lib
from mgrpo_jax.envs.world import (Question, WorldConfig, generate_world, make_questions,
                                  split_questions)  # fmt: skip


@pytest.fixture(scope="module")
def world():
  return generate_world(WorldConfig(seed=7))


@pytest.fixture(scope="module")
def questions(world):
  return make_questions(world, num=150, seed=3)


def _sentences(text):
  return re.split(r"(?<=[.!?])\s+", text)


def test_same_seed_same_world_and_questions():
  a, b = generate_world(WorldConfig(seed=11)), generate_world(WorldConfig(seed=11))
  assert a.entities == b.entities and a.documents == b.documents
  assert make_questions(a, num=40, seed=5) == make_questions(b, num=40, seed=5)


def test_other_seed_other_world():
  a, b = generate_world(WorldConfig(seed=1)), generate_world(WorldConfig(seed=2))
  assert [e.name for e in a.entities] != [e.name for e in b.entities]
  w = generate_world(WorldConfig(seed=1))
  assert make_questions(w, num=40, seed=1) != make_questions(w, num=40, seed=2)


def test_sizes_and_unique_names(world):
  cfg = world.config
  kinds = [e.kind for e in world.entities]
  assert kinds.count("person") == cfg.num_people and kinds.count("work") == cfg.num_works
  assert kinds.count("organisation") == cfg.num_orgs and kinds.count("place") == cfg.num_places
  names = [e.name.lower() for e in world.entities]
  assert len(set(names)) == len(names)
  assert len({d.doc_id for d in world.documents}) == len(world.documents) == len(names)


def test_names_are_invented_words(world):
  for entity in world.entities:
    for word in entity.name.split():
      assert re.fullmatch(r"[A-Z][a-z]+", word), entity.name
      # Pronounceable: no run of more than three consonants.
      assert not re.search(r"[^aeiou]{4}", word.lower()), word


def test_links_point_to_entities_of_the_right_kind(world):
  for entity in world.entities:
    for attr, kind in world_lib.LINKS.items():
      if attr in entity.attributes:
        assert world.entity(entity.attributes[attr]).kind == kind


def test_each_fact_is_a_sentence_of_the_entity_document(world):
  for entity in world.entities:
    doc = world.document(entity.doc_id)
    assert doc.title == entity.name
    for attr, value in entity.attributes.items():
      # A sentence names both the entity and the value verbatim, so an agent can copy it.
      assert any(entity.name in s and value in s for s in _sentences(doc.text)), (attr, doc.text)


def test_distractors_mention_other_entities():
  clean = generate_world(WorldConfig(seed=4, distractors_per_doc=0))
  noisy = generate_world(WorldConfig(seed=4, distractors_per_doc=3))
  for w, extra in ((clean, 0), (noisy, 3)):
    for entity in w.entities:
      text = w.document(entity.doc_id).text
      assert len(_sentences(text)) == len(entity.attributes) + extra
  names = [e.name for e in noisy.entities]
  doc = noisy.document(noisy.entities[0].doc_id)
  related = set(noisy.entities[0].attributes.values()) | {noisy.entities[0].name}
  assert any(n in doc.text for n in names if n not in related)


def test_name_similarity_shares_first_syllables():
  def shared_prefixes(w):
    words = [x.lower() for e in w.entities for x in e.name.split() if x[0].isupper()]
    return len(words) - len({x[:3] for x in words})

  plain = generate_world(WorldConfig(seed=5, name_similarity=0.0))
  alike = generate_world(WorldConfig(seed=5, name_similarity=0.9))
  assert shared_prefixes(alike) > shared_prefixes(plain) + 10


def test_question_chains_are_consistent(world, questions):
  assert len(questions) == 150 and len({q.id for q in questions}) == 150
  assert len({q.text for q in questions}) == 150
  for q in questions:
    assert 1 <= len(q.hops) <= 3 and q.difficulty == world_lib.DIFFICULTY[len(q.hops)]
    assert q.answer == q.hops[-1].answer and q.gold_doc_ids == tuple(h.doc_id for h in q.hops)
    assert q.hops[0].entity in q.text
    for hop, nxt in zip(q.hops, q.hops[1:]):
      assert nxt.entity == hop.answer  # each hop starts from the previous hop's answer
    for hop in q.hops:
      entity = world.entity(hop.entity)
      assert entity.doc_id == hop.doc_id and entity.attributes[hop.attribute] == hop.answer
      assert hop.entity in hop.question and hop.answer in world.document(hop.doc_id).text


def test_answers_are_short_and_not_in_the_question(questions):
  for q in questions:
    assert len(q.answer.split()) <= 3 and len(q.answer) <= 30
    # Only earlier hops' entities are named, never an answer (no cycles, no leaks).
    assert not re.search(rf"\b{re.escape(q.answer)}\b", q.text), q.text
    for hop in q.hops:
      assert hop.answer not in hop.question


def test_example_phrasings(world):
  qs = make_questions(world, num=300, hop_weights=(0, 0, 1), seed=0)
  org = next(q for q in qs if [h.attribute for h in q.hops] == ["founder", "birthplace", "country"])
  assert org.text == f"In which country is the birthplace of the founder of {org.hops[0].entity}?"


def test_hop_weights_pick_levels(world):
  assert {len(q.hops) for q in make_questions(world, num=30, hop_weights=(0, 1, 0))} == {2}
  mixed = make_questions(world, num=10, hop_weights=(0.5, 0.3, 0.2))
  assert sorted(len(q.hops) for q in mixed) == [1] * 5 + [2] * 3 + [3] * 2


def test_too_many_questions_raises():
  tiny = generate_world(WorldConfig(num_people=1, num_orgs=1, num_places=1, num_works=0))
  with pytest.raises(ValueError, match="1-hop"):
    make_questions(tiny, num=50, hop_weights=(1,))
  with pytest.raises(ValueError, match="hop_weights"):
    make_questions(tiny, num=1, hop_weights=(0, 0))


def test_split_has_disjoint_start_entities(questions):
  train, test = split_questions(questions, 0.25, seed=1)
  assert len(train) + len(test) == len(questions)
  assert 0.25 * len(questions) <= len(test) < 0.25 * len(questions) + 15
  assert not {q.id for q in train} & {q.id for q in test}
  assert not {q.text for q in train} & {q.text for q in test}
  assert not {q.hops[0].entity for q in train} & {q.hops[0].entity for q in test}
  assert split_questions(questions, 0.25, seed=1) == (train, test)
  assert split_questions(questions, 0.25, seed=2) != (train, test)


def test_split_groups_hopless_questions_by_id():
  qs = [Question(f"x{i}", f"q{i}?", "a") for i in range(10)]
  train, test = split_questions(qs, 0.3)
  assert len(test) == 3 and len(train) == 7
  with pytest.raises(ValueError):
    split_questions(qs, 1.5)


def test_vocabulary_holds_every_name_value_and_doc_id(world):
  words = world_lib.vocabulary(world)
  assert list(words) == sorted(set(words))
  for e in world.entities:
    assert e.name in words and e.doc_id in words
    assert set(e.attributes.values()) <= set(words)
  assert "What size of settlement is " in words and " lie?" in words  # question stems
  assert world_lib.vocabulary(generate_world(WorldConfig(seed=7))) == words
  assert " counts as " not in words  # page phrases only with phrases=True


def test_vocabulary_phrases_cover_every_page_template(world):
  words = world_lib.vocabulary(world, phrases=True)
  assert list(words) == sorted(set(words)) and set(world_lib.vocabulary(world)) < set(words)
  assert {"By population, ", " counts as ", " lies on the river "} <= set(words)
  # Every page is then mostly words: its fixed text is never spelled out byte by byte.
  tok = byte_tokenizer.ByteTokenizer(words=words)
  for doc in world.documents:
    ids = tok.encode(doc.text)
    assert tok.decode(ids) == doc.text
    runs = re.findall(r"[^\x00]+", "".join(tok.decode([i]) if i < 256 else "\x00" for i in ids))
    assert {r.strip(" .,0123456789") for r in runs} <= {"", "a", "an"}, (doc.text, runs)
