"""User data checked before the first step: every record of a question file or corpus.

The readers (`datasets.read_qa`, `retrieval`'s corpus index) stream their files line by
line (`lines`, with a progress bar on a terminal), decode each line as UTF-8 and hand
every bad record to a `Problems` list: the file and line, the field, what was expected.
`Problems.finish` then either raises `DataErrors`, listing the first `limit` of them and
how many records in all are bad, or, with `skip_invalid` (`config.data.skip_invalid`),
logs how many records are dropped. So a malformed line, a missing field, an empty answer,
a duplicate id, a corpus line without `contents`, a file in another encoding or a question
whose supporting paragraph the corpus lacks is named before any training starts.
"""

from __future__ import annotations

import codecs
import hashlib
import json
import os
import sys
from typing import Iterator

from absl import logging
from tqdm import auto as tqdm

LIMIT = 20  # Problems listed in the error; the rest are counted.

# Byte-order marks of the encodings a user's editor may have saved a file in.
_BOMS = ((codecs.BOM_UTF32_LE, "UTF-32"), (codecs.BOM_UTF32_BE, "UTF-32"),
         (codecs.BOM_UTF16_LE, "UTF-16"), (codecs.BOM_UTF16_BE, "UTF-16"))  # fmt: skip


class DatasetError(ValueError):
  """A question file or corpus has a record that is not usable."""


class DataErrors(DatasetError):
  """Every bad record found (the first `LIMIT` listed), raised before the first step."""

  def __init__(self, problems: list[str], bad: int, total: int, files: str):
    self.problems, self.bad, self.total = problems, bad, total
    more = f"\n  ... and {bad - len(problems)} more" if bad > len(problems) else ""
    super().__init__(f"{bad} of {total} records of {files} are not usable:\n  "
                     + "\n  ".join(problems) + more
                     + "\nFix them, or set config.data.skip_invalid=True to leave them out.")


class Problems:
  """The bad records met while reading (one problem each), in order."""

  def __init__(self, limit: int = LIMIT):
    self.limit, self.listed, self.bad, self.total = limit, [], 0, 0
    self.files: list[str] = []

  def add(self, where: str, what: str) -> None:
    """A bad record at `where` ("file:line"), `what` saying the field and what was expected."""
    self.bad += 1
    if len(self.listed) < self.limit:
      self.listed.append(f"{where}: {what}")

  def read(self, path: str, records: int = 1) -> None:
    """Notes `records` more records read from `path` (good and bad)."""
    self.total += records
    if path not in self.files:
      self.files.append(path)

  def finish(self, *, skip_invalid: bool) -> int:
    """Raises `DataErrors` when a record was bad, unless `skip_invalid`: then logs how many
    are left out. Returns the number of bad records."""
    if self.bad and not skip_invalid:
      raise DataErrors(self.listed, self.bad, self.total, " and ".join(self.files))
    if self.bad:
      logging.warning("Left out %d of %d records of %s (config.data.skip_invalid): %s",
                      self.bad, self.total, " and ".join(self.files),
                      "; ".join(self.listed[:3]))  # fmt: skip
    return self.bad


def encoding_problem(head: bytes) -> str | None:
  """Why a file starting with `head` is not UTF-8 text, when its byte-order mark says so."""
  for bom, name in _BOMS:
    if head.startswith(bom):
      return f"the file is {name} (it starts with a byte-order mark); save it as UTF-8"
  return None


def decode(raw: bytes) -> tuple[str | None, str | None]:
  """(text, None) of a UTF-8 line, or (None, why not) naming the first bad byte."""
  try:
    return raw.decode("utf-8"), None
  except UnicodeDecodeError as e:
    return None, (f"not UTF-8 (byte 0x{raw[e.start]:02x} at column {e.start + 1}; "
                  "Latin-1 or Windows-1252?); save the file as UTF-8")


def lines(path: str, *, desc: str = "Checking") -> Iterator[tuple[int, str | None, str | None]]:
  """(line number, text, None) per non-blank line of `path`, or (number, None, why) for a
  line that is not UTF-8; streamed, with a progress bar (bytes) when stderr is a terminal.
  A file in UTF-16 or UTF-32 is one problem, at line 1."""
  size = os.path.getsize(path)
  with open(path, "rb") as f, tqdm.tqdm(total=size, unit="B", unit_scale=True,
                                        desc=f"{desc} {os.path.basename(path)}",
                                        disable=not sys.stderr.isatty()) as bar:  # fmt: skip
    head = f.read(4)
    f.seek(0)
    wrong = encoding_problem(head)
    if wrong:
      yield 1, None, wrong
      return
    for number, raw in enumerate(f, 1):
      bar.update(len(raw))
      if number == 1 and raw.startswith(codecs.BOM_UTF8):
        raw = raw[len(codecs.BOM_UTF8):]  # UTF-8 with a mark (Windows editors): fine.
      if not raw.strip():
        continue
      text, why = decode(raw)
      yield number, text, why


def check_corpus(path: str, problems: Problems) -> set[int]:
  """Checks every line of an `{"id", "contents"}` JSONL corpus; returns the bad lines' numbers
  (each added to `problems`). A file in another encoding raises at once: nothing of it reads."""
  seen, bad = set(), set()
  for number, text, why in lines(path):
    problems.read(path)
    what = why or _corpus_problem(text, seen)
    if what is not None:
      if number == 1 and why and why.startswith("the file is"):
        problems.add(path, why)
        raise DataErrors(problems.listed, problems.bad, problems.total, path)
      problems.add(f"{path}:{number}", what)
      bad.add(number)
  return bad


def _corpus_problem(text: str, seen: set) -> str | None:
  """What is wrong with one corpus line (None: nothing); `seen` holds the ids so far."""
  try:
    record = json.loads(text.rstrip("\r\n"))
  except json.JSONDecodeError as e:
    return f"not valid JSON ({e.msg} at column {e.colno})"
  if not isinstance(record, dict):
    return f'expected a JSON object {{"id", "contents"}}, got {type(record).__name__}'
  contents, doc_id = record.get("contents"), record.get("id")
  if contents is None:
    return (f"missing field 'contents' (the document: its title on the first line, then its "
            f"text); keys present: {sorted(record)}")
  if not isinstance(contents, str) or not contents.strip():
    return f"field 'contents' must be non-empty text, got {str(contents)[:60]!r}"
  if isinstance(doc_id, bool) or not isinstance(doc_id, (str, int)) or not str(doc_id).strip():
    return f"field 'id' must be a non-empty string or integer, got {str(doc_id)[:60]!r}"
  key = hashlib.blake2b(str(doc_id).encode("utf-8"), digest_size=8).digest()
  if key in seen:  # Hashes, not ids: a corpus of millions of lines stays small in memory.
    return f"duplicate id {str(doc_id)!r} (an earlier line has it)"
  seen.add(key)
  return None
