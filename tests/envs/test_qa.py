"""task=qa data: the MuSiQue / HotpotQA / JSONL loaders, the corpus, EM/F1 and hop recall."""

import json
import pathlib

import ml_collections
import pytest

from mgrpo_jax.envs import qa, retrieval
from mgrpo_jax.envs.datasets import DatasetError, load_qa
from mgrpo_jax.rl import rewards

DATA = pathlib.Path(__file__).parents[1] / "data" / "qa"
_R = ml_collections.ConfigDict(dict(k1=1.2, b=0.75, index_dir="", timeout_s=5.0))


def test_musique_hops_aliases_and_paragraphs():
  qs = load_qa(DATA / "musique.jsonl", "musique")
  assert len(qs) == 12 and len({q.id for q in qs}) == 12
  q = qs[0]
  assert q.answers == ("G. Stanley Hall", "Stanley Hall") and len(q.paragraphs) == 20
  assert [h.question for h in q.hops] == ["What company published Journal of Psychotherapy "
                                          "Integration?", "Who was the first president of #1 ?"]
  # The last hop accepts the question's aliases; the support is the record's paragraph.
  assert q.hops[0].answers == ("American Psychological Association",)
  assert q.hops[1].answers == ("G. Stanley Hall", "Stanley Hall")
  assert "American Psychological Association" in q.hops[0].support[0].text
  assert qs[1].hops[0].question == "Hello Love >> performer" and len(qs[1].hops) == 4


def test_hotpotqa_hops_from_supporting_facts():
  qs = load_qa(DATA / "hotpotqa.json", "hotpotqa")
  bridge = qs[0]  # Haymo of Faversham -> Recovery of Aristotle -> Latin.
  assert [h.support[0].title for h in bridge.hops] == ["Haymo of Faversham",
                                                       "Recovery of Aristotle"]
  assert bridge.hops[0].answers == ("Recovery of Aristotle",) and bridge.final == "last"
  assert bridge.hops[1].question.startswith("#1: ") and bridge.hops[1].answers == ("Latin",)
  comparison = qs[2]  # Watertown vs Alexandria airports: "no", judged from both pages.
  assert comparison.final == "gold" and comparison.answer == "no" and len(comparison.hops) == 2
  assert all(h.answers[0] in h.support[0].text for h in comparison.hops)
  assert len(comparison.paragraphs) == 10


def test_json_list_and_jsonl_both_read(tmp_path):
  rows = [{"qid": "a", "q": "Who?", "answers": ["Ada Lovelace", "Ada"]},
          {"qid": "b", "q": "When?", "answers": 1843}]
  fields = {"id": "qid", "question": "q", "answer": "answers"}
  (tmp_path / "d.json").write_text(json.dumps(rows))
  (tmp_path / "d.jsonl").write_text("\n".join(map(json.dumps, rows)) + "\n\n")
  for name in ("d.json", "d.jsonl"):
    a, b = load_qa(tmp_path / name, "jsonl", fields=fields)
    assert (a.id, a.text, a.answers, a.hops, a.paragraphs) == ("a", "Who?", ("Ada Lovelace", "Ada"),
                                                              (), ())
    assert (b.id, b.answer) == ("b", "1843")


@pytest.mark.parametrize("fmt,body,needle", [
  ("musique", '{"id": "x", "question": "Q?", "answer": "A", "paragraphs": [], '
   '"question_decomposition": [{"question": "q", "answer": "a", "paragraph_support_idx": 3}]}',
   "m.jsonl:2: question_decomposition[0]: paragraph_support_idx 3"),
  ("musique", '{"id": "x", "answer": "A"}', "m.jsonl:2: missing field 'paragraphs'"),
  ("jsonl", '{"question": "Q?"}', "m.jsonl:2: missing field 'answer'"),
  ("jsonl", '{"question": "Q?", "answer": "A"', "m.jsonl:2: not valid JSON"),
  ("hotpotqa", '{"_id": "h", "question": "Q?", "answer": "A", "context": [["T", ["s."]]], '
   '"supporting_facts": [["U", 0]]}', "m.jsonl:2: supporting_facts[0]"),
])  # fmt: skip
def test_bad_records_name_file_line_and_field(tmp_path, fmt, body, needle):
  path = tmp_path / "m.jsonl"
  path.write_text("\n" + body + "\n")
  with pytest.raises(DatasetError, match=needle.replace("[", r"\[").replace("]", r"\]")):
    load_qa(path, fmt)


def test_duplicate_ids_and_unknown_format(tmp_path):
  path = tmp_path / "d.jsonl"
  path.write_text('{"id": 1, "question": "a", "answer": "b"}\n'
                  '{"id": 1, "question": "c", "answer": "d"}\n')
  with pytest.raises(DatasetError, match=r"d.jsonl:2: duplicate id '1' \(first at .*d.jsonl:1\)"):
    load_qa(path, "jsonl")
  with pytest.raises(ValueError, match="QA format 'squad'"):
    load_qa(path, "squad")


def test_corpus_dedups_by_title_and_text_and_recall_finds_support(tmp_path):
  qs = load_qa(DATA / "musique.jsonl", "musique")
  docs = qa.corpus_documents(qs + qs)  # A file read twice adds nothing.
  assert len(docs) == len({(d.title, d.text) for d in docs}) < 12 * 20
  index, held = qa.make_retriever("", _R, qs)
  assert held == docs
  support = qs[0].hops[1].support[0]
  assert qa.hop_recall(qs[0], [qa.doc_id(support)], index) == [False, True]
  # A JSONL corpus without the supporting paragraphs: recall is judged by title and text.
  path = retrieval.export_corpus(qa.without_support(docs, qs), str(tmp_path / "c.jsonl"))
  jsonl_index, none = qa.make_retriever(path, _R, qs)
  assert none == () and jsonl_index.lookup(qa.doc_id(support)) is None
  other = docs[0].doc_id
  assert jsonl_index.lookup(other) is not None
  with pytest.raises(ValueError, match="data.corpus"):
    qa.make_retriever("", _R, load_qa(_jsonl(tmp_path), "jsonl"))


def _jsonl(tmp_path):
  path = tmp_path / "plain.jsonl"
  path.write_text('{"question": "Q?", "answer": "A"}\n')
  return path


def test_em_and_f1_count_aliases():
  q = load_qa(DATA / "musique.jsonl", "musique")[0]
  assert qa.scores("Stanley Hall.", q) == (1.0, 1.0)  # An alias, normalised.
  em, f1 = qa.scores("the president G. Hall", q)
  assert em == 0.0 and f1 == pytest.approx(rewards.token_f1("president G. Hall", "G. Stanley Hall"))
  assert qa.scores(None, q) == (0.0, 0.0)
  assert rewards.best_f1("Hall", ["G. Stanley Hall", "Stanley Hall"]) == pytest.approx(2 / 3)
