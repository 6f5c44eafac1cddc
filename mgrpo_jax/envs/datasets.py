"""Question files: the deep-research benchmarks (GAIA, XBench-DeepSearch, WebWalkerQA) and
multi-hop QA data with its paragraphs and gold structure (MuSiQue, HotpotQA, any JSONL).

Each reads a local jsonl file (one JSON object per line; blank lines skipped) into `Question`
records with `id`, `text` and `answer`, so benchmark questions flow through the same rollout
and reward code as the offline world's. Field names differ between releases, so each loader
tries a few known names per field, and `field_map` overrides them (a dotted name such as
"info.difficulty_level" reaches into a nested object). A bad line raises `DatasetError` naming
the file, the line number and the field. The benchmarks' questions need live web search.

`load_qa` reads multi-hop QA (task=qa): MuSiQue (its decomposition: one `QAHop` per
sub-question), HotpotQA's distractor setting (hops from the supporting facts) or "jsonl" (any
file of questions and answers, no gold structure), each with its records' paragraphs. It
checks every record before returning (`envs.data_checks`): all the bad ones are named at
once, or left out with `skip_invalid`.
"""

from __future__ import annotations

import codecs
import dataclasses
import json
import os
from typing import Any, Iterator, Mapping, Sequence

from mgrpo_jax.envs import data_checks
from mgrpo_jax.envs.data_checks import DatasetError
from mgrpo_jax.envs.world import Question
from mgrpo_jax.rl.rewards import normalize_answer

_KEYS = ("id", "text", "answer", "difficulty")
# Known field names, tried in order. An empty tuple means the field is optional and absent.
GAIA_FIELDS = {"id": ("task_id",), "text": ("Question",),
               "answer": ("Final answer", "Final Answer"), "difficulty": ("Level",)}  # fmt: skip
XBENCH_FIELDS = {"id": ("id",), "text": ("prompt", "question"), "answer": ("answer",),
                 "difficulty": ()}  # fmt: skip
WEBWALKER_FIELDS = {"id": ("id",), "text": ("question",), "answer": ("answer",),
                    "difficulty": ("difficulty_level", "info.difficulty_level")}  # fmt: skip


def _get(record: Mapping[str, Any], name: str) -> Any:
  """`record[name]`, or the nested value at a dotted path; None when absent."""
  if name in record:
    return record[name]
  value: Any = record
  for part in name.split("."):
    if not isinstance(value, Mapping) or part not in value:
      return None
    value = value[part]
  return value


def _text(value: Any) -> str | None:
  """Strings as they are, numbers as text (some releases store numeric answers); else None."""
  if isinstance(value, str):
    return value.strip() or None
  if isinstance(value, (int, float)) and not isinstance(value, bool):
    return str(value)
  return None


def _field(record, names: Sequence[str], where: str, key: str, required: bool) -> str | None:
  for name in names:
    value = _text(_get(record, name))
    if value is not None:
      return value
  if required:
    tried = " or ".join(repr(n) for n in names) or "(no field name)"
    raise DatasetError(f"{where}: missing or empty field {tried} for {key!r}; "
                       f"keys present: {sorted(record)}")  # fmt: skip
  return None


def load_jsonl_questions(path: str | os.PathLike, *, source: str,
                         fields: Mapping[str, Sequence[str]],
                         field_map: Mapping[str, str] | None = None,
                         id_optional: bool = False) -> list[Question]:  # fmt: skip
  """Reads `path` into Questions using `fields` (key -> names to try), overridden by `field_map`.

  With `id_optional`, a record without an id gets "<source>-<index>" (index counts records,
  from 0). Ids must be unique within a file.
  """
  names = {k: tuple(fields.get(k, ())) for k in _KEYS}
  for key, name in (field_map or {}).items():
    if key not in _KEYS:
      raise ValueError(f"field_map keys must be among {_KEYS}, got {key!r}")
    names[key] = (name,)
  questions, first_line = [], {}
  with open(path, encoding="utf-8") as f:
    for line_no, line in enumerate(f, start=1):
      if not line.strip():
        continue
      where = f"{os.fspath(path)}:{line_no}"
      try:
        record = json.loads(line)
      except json.JSONDecodeError as e:
        raise DatasetError(f"{where}: not valid JSON ({e.msg})") from None
      if not isinstance(record, dict):
        raise DatasetError(f"{where}: expected a JSON object, got {type(record).__name__}")
      qid = _field(record, names["id"], where, "id", not id_optional)
      qid = qid if qid is not None else f"{source}-{len(questions)}"
      if qid in first_line:
        raise DatasetError(f"{where}: duplicate id {qid!r} (first on line {first_line[qid]})")
      first_line[qid] = line_no
      questions.append(Question(
        id=qid, text=_field(record, names["text"], where, "text", True),
        answer=_field(record, names["answer"], where, "answer", True),
        difficulty=_field(record, names["difficulty"], where, "difficulty", False) or "",
        source=source))  # fmt: skip
  return questions


def load_gaia(path: str | os.PathLike, *, field_map: Mapping[str, str] | None = None
              ) -> list[Question]:  # fmt: skip
  """GAIA (`metadata.jsonl`): "task_id", "Question", "Final answer"; "Level" -> difficulty."""
  return load_jsonl_questions(path, source="gaia", fields=GAIA_FIELDS, field_map=field_map)


def load_xbench_deepsearch(path: str | os.PathLike, *, field_map: Mapping[str, str] | None = None
                           ) -> list[Question]:  # fmt: skip
  """XBench-DeepSearch: "id", "prompt" (or "question"), "answer"."""
  return load_jsonl_questions(path, source="xbench-deepsearch", fields=XBENCH_FIELDS,
                              field_map=field_map)  # fmt: skip


def load_webwalkerqa(path: str | os.PathLike, *, field_map: Mapping[str, str] | None = None
                     ) -> list[Question]:  # fmt: skip
  """WebWalkerQA: "question", "answer", optional "id" (else "webwalkerqa-<index>")."""
  return load_jsonl_questions(path, source="webwalkerqa", fields=WEBWALKER_FIELDS,
                              field_map=field_map, id_optional=True)  # fmt: skip


LOADERS = {"gaia": load_gaia, "xbench-deepsearch": load_xbench_deepsearch,
           "webwalkerqa": load_webwalkerqa}  # fmt: skip


def load_benchmark(name: str, path: str | os.PathLike, *,
                   field_map: Mapping[str, str] | None = None) -> list[Question]:  # fmt: skip
  """Loads benchmark `name` (a key of LOADERS) from `path`."""
  if name not in LOADERS:
    raise ValueError(f"unknown benchmark {name!r}; known: {sorted(LOADERS)}")
  return LOADERS[name](path, field_map=field_map)


# --------------------------------------------------------------- multi-hop QA (task=qa)

QA_FORMATS = ("musique", "hotpotqa", "jsonl")


@dataclasses.dataclass(frozen=True)
class Paragraph:
  """One paragraph of a QA record (gold or distractor): a page of the corpus."""

  title: str
  text: str

  @property
  def key(self) -> tuple[str, str]:
    """What deduplicates paragraphs: the title and the text, whitespace collapsed."""
    return " ".join(self.title.split()), " ".join(self.text.split())


@dataclasses.dataclass(frozen=True)
class QAHop:
  """One step of a QA question's gold structure.

  `question` may hold `#k` for hop k's answer (1-based, MuSiQue's convention); `answers` are
  the accepted sub-answers (the first is the gold one); `support` the paragraphs holding it.
  """

  question: str
  answers: tuple[str, ...]
  support: tuple[Paragraph, ...]


@dataclasses.dataclass(frozen=True)
class QAQuestion(Question):
  """A real multi-hop question: `hops` are `QAHop`s (empty for "jsonl": no gold structure).

  `paragraphs` are the record's own paragraphs (the default corpus). `final` says how the
  gold answer follows from the hops: "last" (the last hop's answer) or "gold" (a HotpotQA
  comparison: the answer is judged from both hops' findings, which no hop states).
  """

  paragraphs: tuple[Paragraph, ...] = ()
  final: str = "last"


def _records(path: str | os.PathLike, problems: data_checks.Problems) -> Iterator[tuple[str, Any]]:
  """(where, record) of a `.json` list or a `.jsonl` file; `where` names file and line/index.

  A `.jsonl` file is streamed: a line that is not UTF-8 or not JSON is a problem of its own
  and the others are still read. A `.json` list is read whole (one problem ends it)."""
  path = os.fspath(path)
  if not os.path.isfile(path):
    raise DatasetError(f"{path}: no such file")
  with open(path, "rb") as f:
    head = f.read(4096)
  if path.endswith(".json") or head.lstrip(codecs.BOM_UTF8).lstrip().startswith(b"["):
    yield from _json_list(path, problems)
    return
  for line_no, text, why in data_checks.lines(path):
    problems.read(path)
    where = f"{path}:{line_no}"
    if why is not None:
      problems.add(where, why)
      continue
    try:
      yield where, json.loads(text.rstrip("\r\n"))
    except json.JSONDecodeError as e:
      problems.add(where, f"not valid JSON ({e.msg} at column {e.colno})")


def _json_list(path: str, problems: data_checks.Problems) -> Iterator[tuple[str, Any]]:
  with open(path, "rb") as f:
    raw = f.read()
  problems.read(path, 0)
  text, why = None, data_checks.encoding_problem(raw[:4])
  line = 1
  if why is None:
    try:
      text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
      line = raw[:e.start].count(b"\n") + 1
      why = data_checks.decode(raw[raw.rfind(b"\n", 0, e.start) + 1:e.end])[1]
  if why is not None:
    problems.read(path)
    problems.add(f"{path}:{line}", why)
    return
  try:
    data = json.loads(text.lstrip("\ufeff"))
  except json.JSONDecodeError as e:
    problems.read(path)
    problems.add(f"{path}:{e.lineno}", f"not valid JSON ({e.msg})")
    return
  if not isinstance(data, list):
    problems.read(path)
    problems.add(path, f"a .json file must hold a list of records, got {type(data).__name__}")
    return
  problems.read(path, len(data))
  for i, record in enumerate(data):
    yield f"{path}: record {i}", record


def _need(record: Any, name: str, where: str, kind: type | tuple) -> Any:
  """`record[name]` (dotted names reach into objects), checked to be of `kind`."""
  if not isinstance(record, dict):
    raise DatasetError(f"{where}: expected a JSON object, got {type(record).__name__}")
  value = _get(record, name)
  if value is None:
    raise DatasetError(f"{where}: missing field {name!r}; keys present: {sorted(record)}")
  if not isinstance(value, kind) or (isinstance(value, str) and not value.strip()):
    want = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
    raise DatasetError(f"{where}: field {name!r} must be a non-empty {want}, "
                       f"got {str(value)[:60]!r}")  # fmt: skip
  return value


def _answers(value: Any, where: str, name: str) -> tuple[str, ...]:
  """A string answer, or a list of accepted ones (the first is the gold answer)."""
  values = value if isinstance(value, list) else [value]
  out = tuple(dict.fromkeys(t for t in map(_text, values) if t is not None))
  if not out:
    raise DatasetError(f"{where}: field {name!r} holds no answer text: {str(value)[:60]!r}")
  return out


def _musique(record: Any, where: str) -> QAQuestion | None:
  """A MuSiQue record; None for an unanswerable one (MuSiQue-full), which has no answer."""
  if isinstance(record, dict) and record.get("answerable") is False:
    return None
  paragraphs = []
  for i, p in enumerate(_need(record, "paragraphs", where, list)):
    at = f"{where}: paragraphs[{i}]"
    paragraphs.append(Paragraph(_need(p, "title", at, str).strip(),
                                _need(p, "paragraph_text", at, str).strip()))  # fmt: skip
  answers = _answers(_need(record, "answer", where, (str, int, float)), where, "answer")
  aliases = _answers(record.get("answer_aliases") or [], where, "answer_aliases") \
      if record.get("answer_aliases") else ()
  answers = tuple(dict.fromkeys(answers + aliases))
  hops = []
  decomposition = _need(record, "question_decomposition", where, list)
  for i, h in enumerate(decomposition):
    at = f"{where}: question_decomposition[{i}]"
    idx = _need(h, "paragraph_support_idx", at, int)
    if not 0 <= idx < len(paragraphs):
      raise DatasetError(f"{at}: paragraph_support_idx {idx} is not among the record's "
                         f"{len(paragraphs)} paragraphs")  # fmt: skip
    hop_answers = _answers(_need(h, "answer", at, (str, int, float)), at, "answer")
    if i == len(decomposition) - 1:  # The last hop answers the question: its aliases count.
      hop_answers = tuple(dict.fromkeys(hop_answers + answers))
    hops.append(QAHop(_need(h, "question", at, str).strip(), hop_answers, (paragraphs[idx],)))
  return QAQuestion(id=str(_need(record, "id", where, (str, int))), text=_need(
      record, "question", where, str).strip(), answer=answers[0], aliases=answers[1:],
      hops=tuple(hops), source="musique", paragraphs=tuple(paragraphs))  # fmt: skip


def _hotpot_hops(question: str, answer: str, kind: str, by_title: dict,
                 facts: dict) -> tuple[tuple[QAHop, ...], str]:
  """Hops from HotpotQA's supporting facts: one per supporting paragraph, in order.

  A bridge question's answer-bearing paragraph goes last; the first hop's sub-answer is the
  bridge entity (the last paragraph's title, when the first one names it) and the last
  hop's the answer, so the answer is the last hop's ("last"). A hop whose paragraph states
  no such short answer reports its supporting sentences; a comparison is judged from both
  hops' sentences ("gold").
  """
  titles = list(facts)
  holds = lambda t, s: f" {normalize_answer(s)} " in f" {normalize_answer(by_title[t].text)} "
  if kind != "comparison":
    titles.sort(key=lambda t: holds(t, answer))  # Stable: the answer's paragraph last.
  hops = []
  for i, t in enumerate(titles):
    sentences = " ".join(facts[t]).strip() or by_title[t].text
    last = i == len(titles) - 1
    if kind != "comparison" and last and holds(t, answer):
      sub = (answer,)
    elif kind != "comparison" and not last and holds(t, titles[-1]):
      sub = (titles[-1],)
    else:
      sub = (sentences,)
    ask = f"{t}: {question}" if i == 0 or kind == "comparison" else f"#{i}: {question}"
    hops.append(QAHop(ask, sub, (by_title[t],)))
  final = "last" if hops and hops[-1].answers == (answer,) else "gold"
  return tuple(hops), final


def _hotpotqa(record: Any, where: str) -> QAQuestion:
  paragraphs, by_title = [], {}
  for i, item in enumerate(_need(record, "context", where, list)):
    if not (isinstance(item, list) and len(item) == 2 and isinstance(item[0], str)
            and isinstance(item[1], list)):  # fmt: skip
      raise DatasetError(f"{where}: context[{i}] must be [title, [sentences]]")
    p = Paragraph(item[0].strip(), "".join(map(str, item[1])).strip())
    paragraphs.append(p)
    by_title.setdefault(p.title, p)
  facts: dict[str, list[str]] = {}
  for i, fact in enumerate(_need(record, "supporting_facts", where, list)):
    if not (isinstance(fact, list) and len(fact) == 2 and fact[0] in by_title):
      raise DatasetError(f"{where}: supporting_facts[{i}] = {str(fact)[:60]!r} must be "
                         f"[title of a context paragraph, sentence index]")  # fmt: skip
    sentences = dict(item for item in record["context"])[fact[0]]
    line = sentences[fact[1]] if isinstance(fact[1], int) and 0 <= fact[1] < len(sentences) else ""
    facts.setdefault(fact[0], []).append(str(line).strip())
  text = _need(record, "question", where, str).strip()
  answer = _answers(_need(record, "answer", where, (str, int, float)), where, "answer")
  hops, final = _hotpot_hops(text, answer[0], str(record.get("type", "bridge")), by_title, facts)
  return QAQuestion(id=str(_need(record, "_id", where, (str, int))), text=text, answer=answer[0],
                    aliases=answer[1:], hops=hops, source="hotpotqa",
                    paragraphs=tuple(paragraphs), final=final,
                    difficulty=str(record.get("level", "")))  # fmt: skip


def _plain(record: Any, where: str, fields: Mapping[str, str], index: int,
           source: str) -> QAQuestion:
  """A "jsonl" record: question and answer(s) under the names `fields` gives; no paragraphs."""
  names = {"id": "id", "question": "question", "answer": "answer", **dict(fields)}
  qid = _get(record, names["id"]) if isinstance(record, dict) else None
  text = _need(record, names["question"], where, str).strip()
  answers = _answers(_need(record, names["answer"], where, (str, int, float, list)), where,
                     names["answer"])  # fmt: skip
  return QAQuestion(id=str(qid) if qid is not None else f"{source}-{index}", text=text,
                    answer=answers[0], aliases=answers[1:], source=source)


def read_qa(path: str | os.PathLike, fmt: str, problems: data_checks.Problems, *,
            fields: Mapping[str, str] | None = None,
            where_of: dict | None = None) -> list[QAQuestion]:  # fmt: skip
  """The usable questions of a QA file, each bad record added to `problems` (see `load_qa`);
  `where_of` (when given) gets each question's file and line, by id."""
  if fmt not in QA_FORMATS:
    raise ValueError(f"QA format {fmt!r}; expected one of {QA_FORMATS}")
  bad = sorted(set(fields or {}) - {"id", "question", "answer"})
  if bad:
    raise ValueError(f"data.fields keys must be among id, question, answer; got {bad}")
  out, first = [], {}
  source = os.path.splitext(os.path.basename(os.fspath(path)))[0]
  for where, record in _records(path, problems):
    try:
      if fmt == "musique":
        q = _musique(record, where)
      elif fmt == "hotpotqa":
        q = _hotpotqa(record, where)
      else:
        q = _plain(record, where, fields or {}, len(out), source)
    except DatasetError as e:  # The record's first problem; the next records are read.
      where_, _, what = str(e).partition(f"{where}: ")
      problems.add(where, what or where_)
      continue
    if q is None:
      continue
    if q.id in first:
      problems.add(where, f"duplicate id {q.id!r} (first at {first[q.id]})")
      continue
    first[q.id] = where
    out.append(q)
  if where_of is not None:
    where_of.update(first)
  return out


def load_qa(path: str | os.PathLike, fmt: str, *, fields: Mapping[str, str] | None = None,
            skip_invalid: bool = False) -> list[QAQuestion]:  # fmt: skip
  """The questions of a QA file: `fmt` "musique", "hotpotqa" or "jsonl" (`fields`: the keys
  "id", "question", "answer" -> the file's names; an answer may be a list of aliases).

  `.json` lists and `.jsonl` files are both read. Every record is checked: bad ones (not
  UTF-8, not JSON, a missing or empty field, a duplicate id) raise one `DataErrors` naming
  each with its file, line (or record index) and field, unless `skip_invalid` leaves them out.
  """
  problems = data_checks.Problems()
  out = read_qa(path, fmt, problems, fields=fields)
  problems.finish(skip_invalid=skip_invalid)
  if not out:
    raise DatasetError(f"{os.fspath(path)}: no {fmt} questions")
  return out
