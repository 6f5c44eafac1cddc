"""The task=qa experts: gold-structure traces that act only through the search tool."""

import pathlib

import pytest

from mgrpo_jax.agents import protocol, qa_experts
from mgrpo_jax.envs import qa, retrieval
from mgrpo_jax.envs.datasets import load_qa

DATA = pathlib.Path(__file__).parents[1] / "data" / "qa"


@pytest.fixture(scope="module")
def musique():
  qs = load_qa(DATA / "musique.jsonl", "musique")
  return qs, qa_experts.oracle(qs)


def test_fill_and_query():
  filled = qa_experts.fill("Who was in charge of #2 ?", ["x", "Austria"])
  assert filled == "Who was in charge of Austria ?"
  assert qa_experts.fill("#3 of #1", ["a"]) == "#3 of a"
  assert qa_experts.query_of("Hello Love >> performer") == "Hello Love performer"


def test_main_fills_hops_with_the_returned_results_not_the_gold(musique):
  qs, _ = musique
  q, main = qs[1], qa_experts.QAMainExpert(think=False)  # Hello Love: 4 hops.
  assert main.turn(q, [], None) == "<delegate>Hello Love >> performer</delegate>"
  # The sub-agent said "Snow" (not the gold "Hank Snow"): hop 2 asks about "Snow".
  assert "What city did Snow live" in main.turn(q, ["Snow"], None)
  assert main.turn(q, ["Snow", "unknown"], None) == "<answer>unknown</answer>"
  assert main.turn(q, ["a", "b", "c", "35"], None) == "<answer>35</answer>"


def test_sub_visits_hits_in_order_and_answers_only_from_a_page_that_states_it(musique):
  qs, known = musique
  docs = qa.corpus_documents(qs)
  index = retrieval.Bm25Retriever.from_documents(docs)
  sub = qa_experts.QASubExpert(known, search_k=3, think=False)
  subtask = "Hello Love >> performer"
  assert sub.turn(subtask, [], None) == "<search>Hello Love performer</search>"
  reply = f"[{docs[0].doc_id}] {docs[0].title}: x\n[{docs[1].doc_id}] {docs[1].title}: y"
  assert sub.turn(subtask, [reply], None) == f"<visit>{docs[0].doc_id}</visit>"
  page = lambda d: f"[{d.doc_id}] {d.title}\n{d.text}"
  assert sub.turn(subtask, [reply, page(docs[0])], None) == f"<visit>{docs[1].doc_id}</visit>"
  # Neither page states Hank Snow: nothing found, after exactly the hits shown.
  nothing = sub.turn(subtask, [reply, page(docs[0]), page(docs[1])], None)
  assert nothing == "<result>unknown</result>"
  gold = qs[1].hops[0].support[0]
  hello = next(d for d in docs if (d.title, d.text) == (gold.title, gold.text))
  assert sub.turn(subtask, [reply, page(hello)], None) == "<result>Hank Snow</result>"
  # A subtask the oracle does not know is never answered.
  assert sub.turn("Hello Love >> composer", [reply, page(hello), page(docs[1])], None) == \
      "<result>unknown</result>"


def test_experts_through_the_search_tool_and_without_the_support(musique):
  qs, known = musique
  docs = qa.corpus_documents(qs)
  full = retrieval.Bm25Retriever.from_documents(docs)
  cut = retrieval.Bm25Retriever.from_documents(qa.without_support(docs, qs))
  runs = [qa_experts.solve_qa(q, full, known, search_k=5) for q in qs]
  assert sum(r["em"] for r in runs) / len(qs) >= 0.5
  assert all(len(r["recall"]) == len(q.hops) for r, q in zip(runs, qs))
  right = next(r for r in runs if r["em"])
  assert all(right["recall"])  # A right chain read every supporting paragraph.
  cut_runs = [qa_experts.solve_qa(q, cut, known, search_k=5) for q in qs]
  assert sum(r["em"] for r in cut_runs) / len(qs) <= 0.1
  assert not any(h for r in cut_runs for h in r["recall"])


def test_hotpotqa_experts_and_valid_traces():
  qs = load_qa(DATA / "hotpotqa.json", "hotpotqa")
  index = retrieval.Bm25Retriever.from_documents(qa.corpus_documents(qs))
  runs = [qa_experts.solve_qa(q, index, qa_experts.oracle(qs), search_k=5) for q in qs]
  assert sum(r["em"] for r in runs) / len(qs) >= 0.5
  assert all(r["answer"] is not None for r in runs)  # Every main episode is format-valid.


def test_jsonl_has_no_experts(tmp_path):
  path = tmp_path / "plain.jsonl"
  path.write_text('{"id": "x", "question": "Q?", "answer": "A"}\n')
  qs = load_qa(path, "jsonl")
  with pytest.raises(qa_experts.NoGoldStructure, match="'x' has no gold structure"):
    qa_experts.oracle(qs)
  with pytest.raises(qa_experts.NoGoldStructure):
    qa_experts.QAMainExpert().turn(qs[0], [], None)


def test_expert_turns_parse():
  qs = load_qa(DATA / "musique.jsonl", "musique")
  text = qa_experts.QAMainExpert(think=True).turn(qs[0], [], None)
  turn = protocol.parse_turn(text, "main")
  assert turn.ok and turn.action == "delegate" and turn.think == "Hop 1 of 2."
