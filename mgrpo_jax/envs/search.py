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
import hashlib
import random
import re
from typing import Any, Callable, Iterable, Mapping, Protocol, Sequence, runtime_checkable

from mgrpo_jax.envs import tool_health
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
  """One search result: which document, its title, the best sentence and the retriever's score."""

  doc_id: str
  title: str
  snippet: str
  score: float


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
  """Runs a tool body, turning any bad input or failure into an error message; the call is
  counted (`tool_health`). A service outage is no reply: it ends the step (on process 0;
  elsewhere its reply is replaced by process 0's anyway)."""
  return tool_health.timed(name, lambda: _reply(name, run, argument),
                           lambda reply: reply.startswith("Error"))


def _reply(name: str, run: Callable[[str], str], argument: Any) -> str:
  if not isinstance(argument, str):
    return f"Error: {name} expects text, got {type(argument).__name__}."
  if not argument.strip():
    return f"Error: {name} needs a non-empty argument."
  try:
    return run(argument)
  except tool_health.ToolOutage:
    if tool_health.raise_here():
      raise
    return f"Error: {name} is unavailable."
  except Exception as e:  # noqa: BLE001 - a policy's bad call must not end the rollout
    return f"Error: {name} failed ({type(e).__name__})."


def shuffled(hits: Sequence[Hit], query: str) -> list[Hit]:
  """`hits` in an order drawn from the query's text alone (the same query, the same order)."""
  seed = int.from_bytes(hashlib.sha1(" ".join(tokenize(query)).encode()).digest()[:8], "big")
  out = list(hits)
  random.Random(seed).shuffle(out)
  return out


@dataclasses.dataclass(frozen=True)
class SearchTool:
  """`search`: the top `k` local documents for a query, formatted by `format_hits`.

  `shuffle`: the k hits in an order drawn from the query (`shuffled`), not by score. A query
  naming an entity ranks its own page first (it names the entity in every sentence), so
  taking the first hit would always be right; shuffled, the agent must pick the hit whose
  title is the entity (among look-alike names), as on a search engine whose ranking errs.
  """

  index: Retriever
  k: int = 3
  name: str = "search"
  shuffle: bool = False

  def _run(self, query: str) -> str:
    hits = self.index.search(query, self.k)
    return format_hits(shuffled(hits, query) if self.shuffle else hits)

  def __call__(self, argument: str) -> str:
    return _guarded(self.name, self._run, argument)


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


def local_tools(index: Retriever, *, k: int = 3, max_chars: int = 800,
                shuffle: bool = False) -> dict[str, Tool]:
  """The sub-agent's offline tool set, keyed by the name a policy calls: search and visit."""
  return {"search": SearchTool(index, k, shuffle=shuffle), "visit": VisitTool(index, max_chars)}
