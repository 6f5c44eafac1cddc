"""The search / visit tools an agent calls with text, over any `Retriever`.

A `Retriever` (envs/retrieval.py: bm25s over a JSONL corpus, or a Search-R1 retriever server)
ranks documents and gives each hit a snippet, its best-matching sentence (`best_sentence`);
`lookup` finds a document by id or title for `visit`. The tools wrap both behind one
text-in, text-out protocol (`Tool`) that never raises: a malformed call by a policy is an
observation for the policy, not a crash of the rollout. `WebSearchTool` is the plug-in point
for a real search API when the web is reachable.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any, Callable, Iterable, Mapping, Protocol, Sequence, runtime_checkable

import numpy as np

from mgrpo_jax.envs.world import Document

_WORD = re.compile(r"[^\W_]+")  # letters and digits of any script; punctuation splits words
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")
_ELLIPSIS = "..."


def tokenize(text: str) -> list[str]:
  """Lower-cased words (runs of letters and digits)."""
  return _WORD.findall(text.lower())


def truncate(text: str, max_chars: int) -> str:
  """`text` cut to at most `max_chars` characters, at a word boundary, ending in "..."."""
  if len(text) <= max_chars:
    return text
  if max_chars <= len(_ELLIPSIS):
    return text[:max(max_chars, 0)]
  cut = text[: max_chars - len(_ELLIPSIS)]
  space = cut.rfind(" ")
  if space > len(cut) // 2:  # prefer a word boundary unless it throws away half the budget
    cut = cut[:space]
  return cut.rstrip() + _ELLIPSIS


def best_sentence(text: str, terms: Iterable[str], weight: Callable[[str], float],
                  max_chars: int) -> str:
  """The sentence of `text` holding the most `weight` of the query `terms` (earliest on ties),
  cut to `max_chars` characters."""
  terms = set(terms)
  best, best_weight = "", -1.0
  for sentence in _SENTENCE_END.split(text):
    w = sum(weight(t) for t in terms & set(tokenize(sentence)))
    if w > best_weight:
      best, best_weight = sentence, w
  return truncate(best, max_chars)


def lookup_key(doc_id_or_title: str) -> str:
  """A visit argument without surrounding spaces, brackets and quotes ("[doc007]" -> "doc007")."""
  return doc_id_or_title.strip().strip("[]\"'`").strip()


@dataclasses.dataclass(frozen=True)
class Hit:
  """One search result: which document, its title, the best sentence and the BM25 score."""

  doc_id: str
  title: str
  snippet: str
  score: float


class SearchIndex:
  """BM25 index over `documents`; the title is indexed together with the text.

  idf(t) = ln(1 + (N - df + 0.5) / (df + 0.5)) (the Lucene form, never negative), and
  score(q, d) = sum over the distinct terms t of q of
  idf(t) * tf * (k1 + 1) / (tf + k1 * (1 - b + b * |d| / avgdl)).
  Repeating a word in the query does not count it twice.
  """

  def __init__(self, documents: Iterable[Document], *, k1: float = 1.2, b: float = 0.75,
               snippet_chars: int = 160):  # fmt: skip
    self.documents = tuple(documents)
    self.k1, self.b, self.snippet_chars = k1, b, snippet_chars
    self._by_id = {d.doc_id: d for d in self.documents}
    if len(self._by_id) != len(self.documents):
      raise ValueError("document ids must be unique")
    self._by_title: dict[str, Document] = {}
    for doc in self.documents:  # the first document wins a shared title
      self._by_title.setdefault(doc.title.strip().lower(), doc)
    postings: dict[str, dict[int, int]] = {}
    lengths = []
    for i, doc in enumerate(self.documents):
      tokens = tokenize(doc.title) + tokenize(doc.text)
      lengths.append(len(tokens))
      for tok in tokens:
        row = postings.setdefault(tok, {})
        row[i] = row.get(i, 0) + 1
    self._lengths = np.asarray(lengths, np.float64)
    n = len(self.documents)
    avgdl = float(self._lengths.mean()) if n and self._lengths.sum() > 0 else 1.0
    # Per-document length normaliser, computed once: k1 * (1 - b + b * |d| / avgdl).
    self._norm = k1 * (1.0 - b + b * self._lengths / avgdl)
    # Postings as arrays: scoring a term is then one vectorised update of the touched rows.
    self._postings = {t: (np.fromiter(r.keys(), np.int64, len(r)),
                          np.fromiter(r.values(), np.float64, len(r)))
                      for t, r in postings.items()}  # fmt: skip
    self.idf = {t: math.log(1.0 + (n - len(r) + 0.5) / (len(r) + 0.5)) for t, r in postings.items()}

  def scores(self, query: str) -> np.ndarray:
    """BM25 score of every document for `query` (float64[N], 0 where no term matches)."""
    total = np.zeros(len(self.documents), np.float64)
    for term in dict.fromkeys(tokenize(query)):  # distinct terms, first-seen order
      if term not in self._postings:
        continue
      docs, tf = self._postings[term]
      total[docs] += self.idf[term] * tf * (self.k1 + 1.0) / (tf + self._norm[docs])
    return total

  def search(self, query: str, k: int = 3) -> list[Hit]:
    """The `k` best documents with a positive score, best first (ties: earlier document)."""
    if k <= 0 or not self.documents:
      return []
    scores = self.scores(query)
    order = np.argsort(-scores, kind="stable")[:k]
    terms = set(tokenize(query))
    return [Hit(self.documents[i].doc_id, self.documents[i].title,
                self._snippet(self.documents[i].text, terms), float(scores[i]))
            for i in order if scores[i] > 0]  # fmt: skip

  def _snippet(self, text: str, terms: set[str]) -> str:
    """The sentence holding the most idf weight of the query terms (earliest on ties)."""
    best, best_weight = "", -1.0
    for sentence in _SENTENCE_END.split(text):
      weight = sum(self.idf.get(t, 0.0) for t in terms & set(tokenize(sentence)))
      if weight > best_weight:
        best, best_weight = sentence, weight
    return truncate(best, self.snippet_chars)

  def lookup(self, doc_id_or_title: str) -> Document | None:
    """The document with this exact id, else with this title (any case), else None.

    Surrounding spaces, brackets and quotes are ignored, so "[doc007]" as copied from a
    search result line finds doc007.
    """
    key = doc_id_or_title.strip().strip("[]\"'`").strip()
    return self._by_id.get(key) or self._by_title.get(key.lower())

  def visit(self, doc_id_or_title: str, max_chars: int = 800) -> str | None:
    """The document's text cut to `max_chars` characters, or None when nothing matches."""
    doc = self.lookup(doc_id_or_title)
    return None if doc is None else truncate(doc.text, max_chars)


@runtime_checkable
class Retriever(Protocol):
  """What the search and visit tools need from a retrieval backend (see envs/retrieval.py)."""

  def search(self, query: str, k: int = 3) -> list[Hit]:
    """The `k` best documents with a positive score, best first."""
    ...

  def lookup(self, doc_id_or_title: str) -> Document | None:
    """The document with this id, else with this title (any case), else None."""
    ...


def format_hits(hits: Sequence[Hit]) -> str:
  """Search results as a tool message: one "[doc_id] Title: snippet" line per hit."""
  if not hits:
    return "No results found."
  return "\n".join(f"[{h.doc_id}] {h.title}: {h.snippet}" for h in hits)


@runtime_checkable
class Tool(Protocol):
  """A tool a policy calls by name with one text argument; it answers with text, never raises."""

  name: str

  def __call__(self, argument: str) -> str: ...


def _guarded(name: str, run: Callable[[str], str], argument: Any) -> str:
  """Runs a tool body, turning any bad input or failure into an error message."""
  if not isinstance(argument, str):
    return f"Error: {name} expects text, got {type(argument).__name__}."
  if not argument.strip():
    return f"Error: {name} needs a non-empty argument."
  try:
    return run(argument)
  except Exception as e:  # noqa: BLE001 - a policy's bad call must not end the rollout
    return f"Error: {name} failed ({type(e).__name__})."


@dataclasses.dataclass(frozen=True)
class SearchTool:
  """`search`: the top `k` local documents for a query, formatted by `format_hits`."""

  index: Retriever
  k: int = 3
  name: str = "search"

  def __call__(self, argument: str) -> str:
    return _guarded(self.name, lambda q: format_hits(self.index.search(q, self.k)), argument)


@dataclasses.dataclass(frozen=True)
class VisitTool:
  """`visit`: a document by id or title, as "[doc_id] Title" then its text (cut to max_chars)."""

  index: Retriever
  max_chars: int = 800
  name: str = "visit"

  def _run(self, key: str) -> str:
    doc = self.index.lookup(key)
    if doc is None:
      shown = truncate(key.strip(), 60)
      return f"Error: no document {shown!r}. Visit a doc id from the search results."
    return f"[{doc.doc_id}] {doc.title}\n{truncate(doc.text, self.max_chars)}"

  def __call__(self, argument: str) -> str:
    return _guarded(self.name, self._run, argument)


def _as_hit(item: Any, rank: int, snippet_chars: int) -> Hit:
  if isinstance(item, Hit):
    return dataclasses.replace(item, snippet=truncate(item.snippet, snippet_chars))
  if not isinstance(item, Mapping):
    raise TypeError(f"search result {rank} is a {type(item).__name__}, not a Hit or mapping")
  doc_id = item.get("url") or item.get("link") or item.get("doc_id") or f"web{rank}"
  snippet = item.get("snippet") or item.get("content") or item.get("text") or ""
  return Hit(str(doc_id), str(item.get("title", "")), truncate(str(snippet), snippet_chars),
             float(item.get("score", 0.0)))  # fmt: skip


@dataclasses.dataclass(frozen=True)
class WebSearchTool:
  """`search` backed by a real web search API: the plug-in point for live benchmarks.

  `search_fn(query, k)` is supplied by the user (a thin wrapper around any search API) and
  returns an iterable of `Hit`s or of mappings with "title", "snippet" (or "content"/"text")
  and "url" (or "link"/"doc_id"). Results render like local ones, with the URL as the id;
  errors raised by `search_fn` come back as an error message. Never called by the tests
  except with a fake function: this project has no network access.
  """

  search_fn: Callable[[str, int], Iterable[Any]]
  k: int = 3
  snippet_chars: int = 160
  name: str = "search"

  def _run(self, query: str) -> str:
    results = list(self.search_fn(query, self.k))[: self.k]
    return format_hits([_as_hit(r, i, self.snippet_chars) for i, r in enumerate(results)])

  def __call__(self, argument: str) -> str:
    return _guarded(self.name, self._run, argument)


def local_tools(index: Retriever, *, k: int = 3, max_chars: int = 800) -> dict[str, Tool]:
  """The sub-agent's offline tool set, keyed by the name a policy calls: search and visit."""
  return {"search": SearchTool(index, k), "visit": VisitTool(index, max_chars)}
