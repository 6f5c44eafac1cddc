"""Loaders for the deep-research benchmarks' question files (GAIA, XBench-DeepSearch, WebWalkerQA).

Each reads a local jsonl file (one JSON object per line; blank lines skipped) into `Question`
records with `id`, `text` and `answer`, so benchmark questions flow through the same rollout
and reward code as the offline world's. Field names differ between releases, so each loader
tries a few known names per field, and `field_map` overrides them (a dotted name such as
"info.difficulty_level" reaches into a nested object). A bad line raises `DatasetError` naming
the file, the line number and the field. The questions need live web search to answer.
"""

from __future__ import annotations

import json
import os
from typing import Any, Mapping, Sequence

from mgrpo_jax.envs.world import Question

_KEYS = ("id", "text", "answer", "difficulty")
# Known field names, tried in order. An empty tuple means the field is optional and absent.
GAIA_FIELDS = {"id": ("task_id",), "text": ("Question",),
               "answer": ("Final answer", "Final Answer"), "difficulty": ("Level",)}  # fmt: skip
XBENCH_FIELDS = {"id": ("id",), "text": ("prompt", "question"), "answer": ("answer",),
                 "difficulty": ()}  # fmt: skip
WEBWALKER_FIELDS = {"id": ("id",), "text": ("question",), "answer": ("answer",),
                    "difficulty": ("difficulty_level", "info.difficulty_level")}  # fmt: skip


class DatasetError(ValueError):
  """A question file has a line that is not a usable record."""


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
