"""Tests for BM25 search, visit and the never-raising tools."""

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mgrpo_jax.envs.search import (Hit, SearchIndex, SearchTool, Tool, VisitTool, WebSearchTool,
                                   format_hits, local_tools, tokenize, truncate)  # fmt: skip
from mgrpo_jax.envs.world import Document, WorldConfig, generate_world, make_questions

# Titles are indexed with the text: doc a = [cat, cat, sat] (3 tokens), b = [dog, dog, sat, down]
# (4), c = [bird, bird] (2); avgdl = 3, N = 3.
_TINY = [Document("a", "Cat", "Cat sat."), Document("b", "Dog", "Dog sat down."),
         Document("c", "Bird", "Bird.")]  # fmt: skip


@pytest.fixture(scope="module")
def world():
  return generate_world(WorldConfig(seed=2, distractors_per_doc=3))


@pytest.fixture(scope="module")
def index(world):
  return SearchIndex(world.documents)


def test_tokenize_lowercases_and_splits_on_punctuation():
  assert tokenize("Halvard's Institute, founded 1873!") == ["halvard", "s", "institute",
                                                          "founded", "1873"]  # fmt: skip
  assert tokenize("snake_case Ünïcode") == ["snake", "case", "ünïcode"]


def test_bm25_matches_hand_computed_scores():
  index = SearchIndex(_TINY)  # k1 = 1.2, b = 0.75
  # idf(cat) = ln(1 + (3 - 1 + .5) / (1 + .5)) = ln(8/3) = 0.980829; in a: tf = 2, |a| = avgdl,
  # so the normaliser is k1 = 1.2 and the tf part 2 * 2.2 / 3.2 = 1.375.
  np.testing.assert_allclose(index.scores("cat"), [1.348640, 0, 0], atol=1e-6)
  # idf(sat) = ln(1 + 1.5 / 2.5) = ln(1.6) = 0.470004. In a: tf part 2.2 / 2.2 = 1. In b:
  # normaliser 1.2 * (0.25 + 0.75 * 4 / 3) = 1.5, tf part 2.2 / 2.5 = 0.88 -> 0.413603.
  np.testing.assert_allclose(index.scores("sat"), [0.470004, 0.413603, 0], atol=1e-6)
  # Terms add up; a repeated query word counts once; unknown words add nothing.
  np.testing.assert_allclose(index.scores("Cat SAT cat zebra"), [1.818644, 0.413603, 0],
                             atol=1e-6)  # fmt: skip
  assert index.idf["cat"] == pytest.approx(math.log(8 / 3))


def test_search_ranks_and_drops_zero_scores():
  hits = SearchIndex(_TINY).search("sat", k=3)
  assert [h.doc_id for h in hits] == ["a", "b"]
  assert hits[0].title == "Cat" and hits[0].score == pytest.approx(0.470004, abs=1e-6)
  assert SearchIndex(_TINY).search("sat", k=0) == []
  assert SearchIndex(_TINY).search("zebra") == []
  assert SearchIndex([]).search("cat") == []


def test_snippet_is_the_best_matching_sentence():
  doc = Document("d", "Lake", "The lake is cold. Boats float on the lake in summer. Fish swim.")
  index = SearchIndex([doc, Document("e", "Hill", "A hill with boats.")])
  assert index.search("summer boats")[0].snippet == "Boats float on the lake in summer."
  short = SearchIndex([doc], snippet_chars=20).search("summer")[0].snippet
  assert len(short) <= 20 and short.endswith("...") and short.startswith("Boats")


def test_one_hop_gold_document_in_top3(world, index):
  questions = make_questions(world, num=150, hop_weights=(1,), seed=0)
  found = [q.gold_doc_ids[0] in {h.doc_id for h in index.search(q.hops[0].entity, k=3)}
           for q in questions]  # fmt: skip
  assert np.mean(found) >= 0.95


def test_every_hop_gold_document_found_by_its_entity_name(world, index):
  questions = make_questions(world, num=60, hop_weights=(0, 0, 1), seed=1)
  found = [h.doc_id in {x.doc_id for x in index.search(h.entity, k=3)}
           for q in questions for h in q.hops]  # fmt: skip
  assert np.mean(found) >= 0.95


def test_visit_by_id_or_title_and_truncation(world, index):
  doc = world.documents[5]
  assert index.visit(doc.doc_id, max_chars=10_000) == doc.text
  assert index.visit(f" [{doc.title.upper()}] ", max_chars=10_000) == doc.text
  cut = index.visit(doc.doc_id, max_chars=50)
  assert len(cut) <= 50 and cut.endswith("...") and doc.text.startswith(cut[:-3])
  assert index.visit("no-such-doc") is None


def test_truncate_edges():
  assert truncate("short", 10) == "short"
  assert truncate("abcdef", 2) == "ab"
  assert truncate("one two three four", 12) == "one two..."


def test_tools_format_results(world, index):
  tools = local_tools(index, k=2, max_chars=60)
  assert all(isinstance(t, Tool) for t in tools.values())
  name = world.entities[0].name
  lines = tools["search"](name).splitlines()
  assert len(lines) == 2 and lines[0].startswith(f"[{world.entities[0].doc_id}] {name}: ")
  page = tools["visit"](world.entities[0].doc_id)
  assert page.startswith(f"[{world.entities[0].doc_id}] {name}\n") and len(page) < 60 + 40
  assert tools["visit"]("nowhere").startswith("Error: no document 'nowhere'")
  assert tools["search"]("   ").startswith("Error:")
  assert tools["search"]("qqqzzz") == "No results found."
  assert format_hits([Hit("d1", "T", "s.", 1.0)]) == "[d1] T: s."


@settings(max_examples=200, deadline=None)
@given(st.one_of(st.text(), st.binary(), st.none(), st.integers(), st.lists(st.text())))
def test_tools_never_raise(argument):
  index = SearchIndex(_TINY)
  web = WebSearchTool(lambda q, k: [{"title": q, "snippet": q * 3, "url": "u"}])
  for tool in (SearchTool(index), VisitTool(index, max_chars=5), web):
    out = tool(argument)
    assert isinstance(out, str) and out


def test_web_search_tool_uses_the_callable_and_reports_errors():
  calls = []

  def fake(query, k):
    calls.append((query, k))
    return [Hit("https://x.org", "X", "About x.", 2.0), {"title": "Y", "content": "Y text",
            "link": "https://y.org"}, {"title": "Z", "snippet": "dropped", "url": "z"}]  # fmt: skip

  tool = WebSearchTool(fake, k=2)
  assert tool("what is x") == "[https://x.org] X: About x.\n[https://y.org] Y: Y text"
  assert calls == [("what is x", 2)]

  def broken(query, k):
    raise TimeoutError("network down")

  assert WebSearchTool(broken)("x") == "Error: search failed (TimeoutError)."
  assert WebSearchTool(lambda q, k: [42])("x") == "Error: search failed (TypeError)."
