"""Tests for the benchmark loaders, on small jsonl files written to tmp_path (no network)."""

import json

import pytest

from mgrpo_jax.envs.datasets import (DatasetError, load_benchmark, load_gaia, load_webwalkerqa,
                                     load_xbench_deepsearch)  # fmt: skip


def _write(tmp_path, rows, name="q.jsonl"):
  path = tmp_path / name
  lines = [r if isinstance(r, str) else json.dumps(r) for r in rows]
  path.write_text("\n".join(lines) + "\n", encoding="utf-8")
  return path


def test_gaia_fields_and_both_answer_spellings(tmp_path):
  path = _write(tmp_path, [
    {"task_id": "t1", "Question": "How many moons?", "Final answer": "2", "Level": 1},
    "",
    {"task_id": "t2", "Question": " Who? ", "Final Answer": "Ada", "file_name": ""},
  ])  # fmt: skip
  q1, q2 = load_gaia(path)
  assert (q1.id, q1.text, q1.answer, q1.difficulty, q1.source) == ("t1", "How many moons?", "2",
                                                                   "1", "gaia")  # fmt: skip
  assert (q2.id, q2.text, q2.answer, q2.difficulty) == ("t2", "Who?", "Ada", "")
  assert q1.hops == () and q1.gold_doc_ids == ()


def test_xbench_prompt_or_question_and_numeric_answers(tmp_path):
  path = _write(tmp_path, [{"id": 7, "prompt": "Year?", "answer": 1999},
                           {"id": "b", "question": "Where?", "answer": "Oslo"}])  # fmt: skip
  qs = load_xbench_deepsearch(path)
  assert [(q.id, q.text, q.answer) for q in qs] == [("7", "Year?", "1999"), ("b", "Where?", "Oslo")]


def test_webwalkerqa_ids_default_to_index(tmp_path):
  path = _write(tmp_path, [
    {"question": "A?", "answer": "a", "info": {"difficulty_level": "easy"}},
    {"id": "w9", "question": "B?", "answer": "b"},
    {"question": "C?", "answer": "c"},
  ])  # fmt: skip
  qs = load_webwalkerqa(path)
  assert [q.id for q in qs] == ["webwalkerqa-0", "w9", "webwalkerqa-2"]
  assert [q.difficulty for q in qs] == ["easy", "", ""]


def test_field_map_overrides_names(tmp_path):
  path = _write(tmp_path, [{"qid": "x", "query": "Q?", "gold": {"text": "G"}}])
  (q,) = load_gaia(path, field_map={"id": "qid", "text": "query", "answer": "gold.text"})
  assert (q.id, q.text, q.answer) == ("x", "Q?", "G")
  with pytest.raises(ValueError, match="field_map keys"):
    load_gaia(path, field_map={"question": "query"})


def test_load_benchmark_dispatches_by_name(tmp_path):
  path = _write(tmp_path, [{"id": "1", "prompt": "P?", "answer": "A"}])
  assert load_benchmark("xbench-deepsearch", path)[0].source == "xbench-deepsearch"
  with pytest.raises(ValueError, match="unknown benchmark"):
    load_benchmark("mmlu", path)


_OK = {"task_id": "t", "Question": "Q?", "Final answer": "a"}


@pytest.mark.parametrize("rows, message", [
  ([{"task_id": "t", "Question": "Q?"}],
   r"q\.jsonl:1: missing or empty field 'Final answer' or 'Final Answer' for 'answer'"),
  ([_OK, {"Question": "Q?", "Final answer": "a"}],
   r"q\.jsonl:2: missing or empty field 'task_id' for 'id'"),
  ([{**_OK, "Question": ""}], r":1: missing or empty field 'Question'"),
  ([{**_OK, "Final answer": None}], r":1: missing .* 'Final answer'"),
  (["", "{not json"], r"q\.jsonl:2: not valid JSON"),
  (["[1, 2]"], r":1: expected a JSON object, got list"),
  ([_OK, _OK], r":2: duplicate id 't' \(first on line 1\)"),
])  # fmt: skip
def test_bad_lines_name_file_line_and_field(tmp_path, rows, message):
  with pytest.raises(DatasetError, match=message):
    load_gaia(_write(tmp_path, rows))


def test_missing_file_raises(tmp_path):
  with pytest.raises(FileNotFoundError):
    load_webwalkerqa(tmp_path / "absent.jsonl")
