"""User data checked before the first step: each kind of bad record named with its file and line."""

import json
import os
import pathlib
import shutil
import subprocess
import sys

import pytest
from absl import logging

from configs import mgrpo
from mgrpo_jax.envs import data_checks, datasets, qa, retrieval
from mgrpo_jax.envs.data_checks import DataErrors

ROOT = pathlib.Path(__file__).resolve().parents[2]
MUSIQUE = ROOT / "tests" / "data" / "qa" / "musique.jsonl"
HOTPOT = ROOT / "tests" / "data" / "qa" / "hotpotqa.json"
_R = mgrpo.get_config("task=qa").retrieval
GOOD = {"id": "q1", "question": "Who?", "answer": "Ada"}


def _jsonl(tmp_path, *rows, name="d.jsonl") -> pathlib.Path:
  """A file of `rows`: dicts as JSON lines, bytes and str as they are."""
  path = tmp_path / name
  with open(path, "wb") as f:
    for row in rows:
      row = json.dumps(row) if isinstance(row, dict) else row
      f.write((row.encode() if isinstance(row, str) else row) + b"\n")
  return path


def _errors(path, fmt="jsonl", **kw) -> DataErrors:
  with pytest.raises(DataErrors) as e:
    datasets.load_qa(path, fmt, **kw)
  return e.value


def test_a_line_in_another_encoding_is_named(tmp_path):
  latin1 = '{"id": "q2", "question": "Qui a écrit ?", "answer": "Zola"}'.encode("latin-1")
  path = _jsonl(tmp_path, GOOD, latin1)
  e = _errors(path)
  column = latin1.index(b"\xe9") + 1
  assert e.problems == [f"{path}:2: not UTF-8 (byte 0xe9 at column {column}; Latin-1 or "
                        "Windows-1252?); save the file as UTF-8"]
  utf16 = tmp_path / "u.jsonl"
  utf16.write_text(json.dumps(GOOD) + "\n", encoding="utf-16")
  assert _errors(utf16).problems == [f"{utf16}:1: the file is UTF-16 (it starts with a "
                                     "byte-order mark); save it as UTF-8"]
  # A .json list (HotpotQA's) names the line of the bad byte.
  data = HOTPOT.read_bytes().replace(b'"answer": "', b'"answer": "\xe9', 1)
  (tmp_path / "h.json").write_bytes(data)
  line = data[:data.index(b"\xe9")].count(b"\n") + 1
  assert _errors(tmp_path / "h.json", "hotpotqa").problems[0].startswith(
      f"{tmp_path / 'h.json'}:{line}: not UTF-8 (byte 0xe9")


def test_utf8_with_a_byte_order_mark_reads(tmp_path):
  path = tmp_path / "bom.jsonl"
  path.write_bytes(b"\xef\xbb\xbf" + json.dumps(GOOD).encode() + b"\n")
  assert [q.id for q in datasets.load_qa(path, "jsonl")] == ["q1"]


def test_a_malformed_line_is_named_and_the_rest_still_read(tmp_path):
  cut = '{"id": "q0", "question": "Q?", "answer": "A"'
  path = _jsonl(tmp_path, cut, GOOD, '["not", "an", "object"]')
  e = _errors(path)
  assert e.problems == [  # The record ends where a comma or a brace was expected.
      f"{path}:1: not valid JSON (Expecting ',' delimiter at column {len(cut) + 1})",
      f"{path}:3: expected a JSON object, got list"]  # fmt: skip
  assert (e.bad, e.total) == (2, 3)


def test_a_missing_field_is_named_with_what_was_expected(tmp_path):
  path = _jsonl(tmp_path, {"id": "a", "answer": "A"}, {"id": "b", "q": "Q?", "answer": "B"})
  e = _errors(path, fields={"question": "q"})
  assert e.problems == [f"{path}:1: missing field 'q'; keys present: ['answer', 'id']"]
  lines = MUSIQUE.read_text().splitlines()
  record = json.loads(lines[1])
  del record["question_decomposition"][0]["paragraph_support_idx"]
  path = _jsonl(tmp_path, lines[0], record, name="m.jsonl")
  assert _errors(path, "musique").problems == [
      f"{path}:2: question_decomposition[0]: missing field 'paragraph_support_idx'; keys "
      f"present: {sorted(record['question_decomposition'][0])}"]  # fmt: skip


def test_an_empty_answer_is_named(tmp_path):
  path = _jsonl(tmp_path, GOOD, {**GOOD, "id": "q2", "answer": "  "},
                {**GOOD, "id": "q3", "answer": []})  # fmt: skip
  assert _errors(path).problems == [
      f"{path}:2: field 'answer' must be a non-empty str or int or float or list, got '  '",
      f"{path}:3: field 'answer' holds no answer text: '[]'"]  # fmt: skip


def test_a_duplicate_id_is_named_with_its_first_line(tmp_path):
  path = _jsonl(tmp_path, GOOD, {**GOOD, "question": "Again?"})
  assert _errors(path).problems == [f"{path}:2: duplicate id 'q1' (first at {path}:1)"]


def test_a_corpus_line_without_contents_is_named(tmp_path):
  corpus = _jsonl(tmp_path, {"id": "a", "contents": '"A"\nText a.'}, {"id": "b", "text": "B"},
                  {"id": "c", "contents": ""}, "{oops", {"id": "a", "contents": "again"},
                  name="corpus.jsonl")  # fmt: skip
  with pytest.raises(DataErrors) as e:
    retrieval.Bm25Retriever.from_jsonl(str(corpus))
  assert e.value.problems == [
      f"{corpus}:2: missing field 'contents' (the document: its title on the first line, "
      "then its text); keys present: ['id', 'text']",
      f"{corpus}:3: field 'contents' must be non-empty text, got ''",
      f"{corpus}:4: not valid JSON (Expecting property name enclosed in double quotes at "
      "column 2)",
      f"{corpus}:5: duplicate id 'a' (an earlier line has it)"]  # fmt: skip
  assert not os.path.exists(f"{corpus}.bm25s")  # Nothing indexed.
  index = retrieval.Bm25Retriever.from_jsonl(str(corpus), skip_invalid=True)
  assert index.num_docs == 1 and index.lookup("a").text == "Text a."
  # The saved index left lines out: loading it without skip_invalid names them again.
  with pytest.raises(DataErrors, match="4 of 5 records"):
    retrieval.Bm25Retriever.from_jsonl(str(corpus))
  assert retrieval.Bm25Retriever.from_jsonl(str(corpus), skip_invalid=True).num_docs == 1


def test_a_question_whose_support_the_corpus_lacks_is_named(tmp_path):
  questions = datasets.load_qa(MUSIQUE, "musique")
  docs = qa.corpus_documents(questions)
  gone = questions[2].hops[1].support[0]
  corpus = retrieval.export_corpus([d for d in docs if d.title != gone.title],
                                   str(tmp_path / "c.jsonl"))  # fmt: skip
  c = mgrpo.get_config("task=qa")
  c.data.update(format="musique", train=str(MUSIQUE), eval="", corpus=corpus)
  with pytest.raises(DataErrors) as e:
    qa.load_data(c.data, c.retrieval)
  lacking = [q for q in questions if any(p.title == gone.title for h in q.hops for p in h.support)]
  assert len(e.value.problems) == len(lacking) >= 1
  hop = next(n for n, h in enumerate(questions[2].hops, 1)
             if all(p.title == gone.title for p in h.support))  # fmt: skip
  assert e.value.problems[0] == (
      f"{MUSIQUE}:3: question {questions[2].id!r}: hop {hop}'s supporting paragraph "
      f"{gone.title!r} is not in the corpus {corpus} (no document of that title)")
  c.data.skip_invalid = True
  train, test, index, _ = qa.load_data(c.data, c.retrieval)
  assert [q.id for q in train] == [q.id for q in questions if q not in lacking] and test == []


def test_every_bad_record_is_listed_up_to_the_limit_or_skipped(tmp_path, monkeypatch):
  rows = [{**GOOD, "id": f"q{i}", "answer": "" if i % 2 else "A"} for i in range(60)]
  path = _jsonl(tmp_path, *rows)
  e = _errors(path)
  assert (e.bad, e.total, len(e.problems)) == (30, 60, data_checks.LIMIT)
  assert e.problems[0].startswith(f"{path}:2: field 'answer'")
  message = str(e)
  assert message.startswith(f"30 of 60 records of {path} are not usable:")
  assert "... and 10 more" in message and "config.data.skip_invalid=True" in message
  warnings = []
  monkeypatch.setattr(logging, "warning", lambda fmt, *a: warnings.append(fmt % a))
  kept = datasets.load_qa(path, "jsonl", skip_invalid=True)
  assert [q.id for q in kept] == [f"q{i}" for i in range(0, 60, 2)]
  assert warnings[0].startswith(f"Left out 30 of 60 records of {path}")


def test_train_launcher_lists_the_bad_records_before_any_step(tmp_path):
  bad = _jsonl(tmp_path, MUSIQUE.read_text().splitlines()[0], "{broken",
               MUSIQUE.read_text().splitlines()[0], name="train.jsonl")  # fmt: skip
  workdir = tmp_path / "run"
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  proc = subprocess.run(
      [sys.executable, "launch/train.py", "--config=configs/mgrpo.py:task=qa,smoke",
       f"--config.data.train={bad}", f"--config.data.eval={MUSIQUE}",
       f"--workdir={workdir}"], cwd=ROOT, env=env, capture_output=True, text=True,
      timeout=300)  # fmt: skip
  assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
  assert f"2 of 15 records of {bad} and {MUSIQUE} are not usable:" in proc.stderr
  assert f"{bad}:2: not valid JSON" in proc.stderr
  assert f"{bad}:3: duplicate id" in proc.stderr
  assert not workdir.exists()  # Nothing trained, nothing left behind.
  shutil.rmtree(tmp_path)
