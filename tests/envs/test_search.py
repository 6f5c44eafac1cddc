"""Tests for the search and visit tools (over bm25s) and their text helpers; the ranking
itself is tested in test_retrieval.py."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mgrpo_jax.envs.retrieval import Bm25Retriever
from mgrpo_jax.envs.search import (Hit, Retriever, SearchTool, Tool, VisitTool, WebSearchTool,
                                   best_sentence, format_hits, local_tools, tokenize,
                                   truncate)  # fmt: skip
from mgrpo_jax.envs.world import Document, WorldConfig, generate_world, make_questions

_TINY = [Document("a", "Cat", "Cat sat."), Document("b", "Dog", "Dog sat down."),
         Document("c", "Bird", "Bird.")]  # fmt: skip


@pytest.fixture(scope="module")
def world():
  return generate_world(WorldConfig(seed=2, distractors_per_doc=3))


@pytest.fixture(scope="module")
def index(world):
  return Bm25Retriever.from_documents(world.documents)


def test_tokenize_lowercases_and_splits_on_punctuation():
  assert tokenize("Halvard's Institute, founded 1873!") == ["halvard", "s", "institute",
                                                          "founded", "1873"]  # fmt: skip
  assert tokenize("snake_case Ünïcode") == ["snake", "case", "ünïcode"]


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


def test_best_sentence_weighs_the_query_words():
  text = "Boats float. The lake is cold in summer. Summer boats race."
  weights = {"summer": 2.0, "boats": 1.0}.get
  assert best_sentence(text, ["summer", "boats"], lambda t: weights(t, 0.0), 80) == \
      "Summer boats race."
  assert best_sentence(text, ["lake"], lambda t: 1.0, 12) == "The lake..."
  assert best_sentence(text, ["zebra"], lambda t: 1.0, 80) == "Boats float."  # earliest


def test_truncate_edges():
  assert truncate("short", 10) == "short"
  assert truncate("abcdef", 2) == "ab"
  assert truncate("one two three four", 12) == "one two..."


def test_tools_format_results(world, index):
  tools = local_tools(index, k=2, max_chars=60)
  assert isinstance(index, Retriever) and all(isinstance(t, Tool) for t in tools.values())
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
  index = Bm25Retriever.from_documents(_TINY)
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
