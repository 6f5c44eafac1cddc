"""Retrieval backends for the search and visit tools: bm25s over a JSONL corpus, or a server.

A corpus is JSONL, one `{"id": ..., "contents": ...}` object a line, the title on the first
line of `contents` (the Search-R1 / FlashRAG convention, e.g. wiki-18.jsonl); `export_corpus`
writes the generated world that way. `Bm25Retriever.from_jsonl` indexes such a file with
`bm25s` once, saves the index beside it (`<corpus>.bm25s/`, or `index_dir`) and memory-maps
it on later loads: the score matrix, and byte offsets into the corpus so a document's text
is read from the file only when it is shown. `HttpRetriever` asks any server speaking
Search-R1's retriever API (`POST /retrieve {"queries", "topk", "return_scores"}`).

Scores are Lucene's BM25: idf(t) = ln(1 + (N - df + 0.5) / (df + 0.5)) and
score(q, d) = sum over the distinct terms t of q of idf(t) * tf / (tf + k1 (1 - b + b |d| / avgdl)).
`bm25s` is imported only when an index is built or loaded: its import runs a JAX op, which
must not happen before a multi-host program has initialised JAX.
"""

from __future__ import annotations

import collections
import hashlib
import http.client
import json
import os
import shutil
import time
import urllib.error
import urllib.request
import uuid
from typing import Iterable, Iterator, Sequence

import numpy as np
from absl import logging
from tqdm import auto as tqdm

from mgrpo_jax.envs import data_checks, search, tool_health
from mgrpo_jax.envs.world import Document, World

_TOKEN_PATTERN = r"[^\W_]+"  # search.tokenize's words, so queries and documents agree.
_FORMAT = 1  # Bumped when the saved index layout changes; an older index is rebuilt.


# ------------------------------------------------------------------------------ corpora


def to_record(doc: Document) -> dict:
  """A document as a corpus line: {"id", "contents"} with the quoted title first."""
  return {"id": doc.doc_id, "contents": f'"{doc.title}"\n{doc.text}'}


def from_record(record: dict, line: int | None = None) -> Document:
  """The document of a corpus line; `line` (1-based) names it in errors."""
  where = f" (line {line})" if line is not None else ""
  if not isinstance(record, dict) or "contents" not in record or "id" not in record:
    raise ValueError(f"A corpus line must be a JSON object with 'id' and 'contents'{where}.")
  title, _, text = str(record["contents"]).partition("\n")
  title = title.strip()
  if len(title) >= 2 and title[0] == title[-1] == '"':
    title = title[1:-1]
  return Document(str(record["id"]), title, text.strip())


def export_corpus(documents: Iterable[Document] | World, path: str) -> str:
  """Writes documents (or a world's) as a JSONL corpus; returns `path`."""
  documents = documents.documents if isinstance(documents, World) else documents
  with open(path, "w", encoding="utf-8") as f:
    for doc in documents:
      f.write(json.dumps(to_record(doc), ensure_ascii=False) + "\n")
  return path


def _key_hash(key: str) -> int:
  """A stable 64-bit hash (Python's `hash` changes between processes)."""
  return int.from_bytes(hashlib.blake2b(key.encode("utf-8"), digest_size=8).digest(), "little")


class _Keys:
  """Rows by id and by lower-cased title, as sorted 64-bit hashes (memory-mappable)."""

  def __init__(self, id_hash, id_row, title_hash, title_row):
    self.arrays = {"id_hash": id_hash, "id_row": id_row, "title_hash": title_hash,
                   "title_row": title_row}  # fmt: skip

  @classmethod
  def build(cls, ids: Sequence[int], titles: Sequence[int]) -> "_Keys":
    out = []
    for hashes in (ids, titles):
      hashes = np.asarray(hashes, np.uint64)
      order = np.argsort(hashes, kind="stable")  # Equal titles: the first document first.
      out += [hashes[order], order.astype(np.int64)]
    return cls(*out)

  def rows(self, which: str, key: str) -> np.ndarray:
    """Candidate rows for a key (hash matches; the caller checks the real key)."""
    hashes, rows = self.arrays[f"{which}_hash"], self.arrays[f"{which}_row"]
    h = np.uint64(_key_hash(key))
    return rows[np.searchsorted(hashes, h, "left"):np.searchsorted(hashes, h, "right")]


class _JsonlDocs:
  """Documents read on demand from a JSONL file at saved byte offsets (one file position:
  not for concurrent threads; the tools are called from one)."""

  def __init__(self, path: str, offsets: np.ndarray):
    self.path, self.offsets = path, offsets
    self._file = open(path, "rb")  # noqa: SIM115 - kept open for the retriever's lifetime

  def __len__(self) -> int:
    return len(self.offsets)

  def __getitem__(self, row: int) -> Document:
    self._file.seek(int(self.offsets[row]))
    return from_record(json.loads(self._file.readline()), None)


# ------------------------------------------------------------------------------- bm25s


class Bm25Retriever:
  """BM25 (`bm25s`, Lucene scoring) over documents held in memory or in a JSONL corpus.

  Build with `from_documents` (in memory, e.g. the generated world) or `from_jsonl` (a
  corpus file, index saved and memory-mapped). Ties rank the earlier document first.
  """

  def __init__(self, model, docs, keys: _Keys, *, snippet_chars: int = 160):
    self.model, self.docs, self.keys, self.snippet_chars = model, docs, keys, snippet_chars
    self.num_docs = len(docs)
    if model is not None:  # df of token t = the stored scores of column t of the CSC matrix.
      indptr = np.asarray(model.scores["indptr"])
      df = np.diff(indptr).astype(np.float64)
      self._idf = np.log1p((self.num_docs - df + 0.5) / (df + 0.5))
      self._vocab = model.vocab_dict

  @classmethod
  def from_documents(cls, documents: Iterable[Document], *, k1: float = 1.2, b: float = 0.75,
                     snippet_chars: int = 160, show_progress: bool = False) -> "Bm25Retriever":
    """An in-memory index over `documents` (ids must be unique)."""
    docs = list(documents)
    ids = [d.doc_id for d in docs]
    if len(set(ids)) != len(ids):
      dup = next(i for i, c in collections.Counter(ids).items() if c > 1)
      raise ValueError(f"Document ids must be unique; {dup!r} repeats.")
    model = _index((to_record(d)["contents"] for d in docs), len(docs), k1, b, show_progress)
    keys = _Keys.build([_key_hash(i) for i in ids],
                       [_key_hash(d.title.strip().lower()) for d in docs])
    return cls(model, docs, keys, snippet_chars=snippet_chars)

  @classmethod
  def from_jsonl(cls, corpus: str, *, index_dir: str | None = None, k1: float = 1.2,
                 b: float = 0.75, snippet_chars: int = 160, show_progress: bool = True,
                 skip_invalid: bool = False) -> "Bm25Retriever":
    """The index of a JSONL corpus: loaded (memory-mapped) when saved and current, else built
    and saved first. `index_dir` defaults to `<corpus>.bm25s` beside the corpus.

    Before an index is built every line is checked (`data_checks.check_corpus`): bad lines
    raise `DataErrors` naming each, or with `skip_invalid` are left out of the index."""
    corpus = os.path.abspath(corpus)
    if not os.path.isfile(corpus):
      raise FileNotFoundError(f"Retrieval corpus {corpus!r} does not exist.")
    index_dir = os.path.abspath(index_dir or corpus + ".bm25s")
    manifest = _manifest(corpus, k1, b)
    saved = _read_manifest(index_dir)
    current = _indexes(saved, manifest)
    if current and saved.get("skipped") and not skip_invalid:  # Bad lines left out: name them.
      problems = data_checks.Problems()
      data_checks.check_corpus(corpus, problems)
      problems.finish(skip_invalid=False)
    if not current:
      if os.path.exists(index_dir):
        logging.warning("Index %s does not match %s (changed corpus or settings); rebuilding.",
                        index_dir, corpus)  # fmt: skip
      _build_and_save(corpus, index_dir, manifest, show_progress, skip_invalid)
    return cls._load(corpus, index_dir, snippet_chars)

  @classmethod
  def _load(cls, corpus: str, index_dir: str, snippet_chars: int) -> "Bm25Retriever":
    import bm25s  # noqa: PLC0415 - see the module docstring

    arrays = {name: np.load(os.path.join(index_dir, f"{name}.npy"), mmap_mode="r")
              for name in ("offsets", "id_hash", "id_row", "title_hash", "title_row")}  # fmt: skip
    model = None
    if len(arrays["offsets"]):
      model = bm25s.BM25.load(os.path.join(index_dir, "bm25s"), mmap=True, show_progress=False)
    keys = _Keys(*(arrays[n] for n in ("id_hash", "id_row", "title_hash", "title_row")))
    return cls(model, _JsonlDocs(corpus, arrays["offsets"]), keys, snippet_chars=snippet_chars)

  def scores(self, query: str) -> np.ndarray:
    """BM25 score of every document for `query` (0 where no term matches)."""
    ids = self._term_ids(query)
    if not ids:
      return np.zeros(self.num_docs, np.float32)
    return self.model.get_scores_from_ids(ids)

  def _term_ids(self, query: str) -> list[int]:
    if self.model is None:
      return []
    terms = dict.fromkeys(search.tokenize(query))  # A repeated word counts once.
    return [self._vocab[t] for t in terms if t in self._vocab]

  def idf(self, term: str) -> float:
    """ln(1 + (N - df + 0.5) / (df + 0.5)) of a corpus word; 0 for a word not in it."""
    i = self._vocab.get(term) if self.model is not None else None
    return 0.0 if i is None else float(self._idf[i])

  def search(self, query: str, k: int = 3) -> list[search.Hit]:
    """The `k` best documents with a positive score, best first (ties: earlier document)."""
    if k <= 0 or self.model is None:
      return []
    scores = self.scores(query)
    rows = _top_k(scores, k)
    terms = search.tokenize(query)
    hits = []
    for row in rows:
      doc = self.docs[int(row)]
      snippet = search.best_sentence(doc.text, terms, self.idf, self.snippet_chars)
      hits.append(search.Hit(doc.doc_id, doc.title, snippet, float(scores[row])))
    return hits

  def lookup(self, doc_id_or_title: str) -> Document | None:
    """The document with this exact id, else with this title (any case), else None.

    Surrounding spaces, brackets and quotes are ignored, so "[doc007]" as copied from a
    search result line finds doc007.
    """
    key = search.lookup_key(doc_id_or_title)
    for which, want, got in (("id", key, lambda d: d.doc_id),
                             ("title", key.lower(), lambda d: d.title.strip().lower())):
      for row in self.keys.rows(which, want):
        doc = self.docs[int(row)]
        if got(doc) == want:
          return doc
    return None

  def visit(self, doc_id_or_title: str, max_chars: int = 800) -> str | None:
    """The document's text cut to `max_chars` characters, or None when nothing matches."""
    doc = self.lookup(doc_id_or_title)
    return None if doc is None else search.truncate(doc.text, max_chars)


def _top_k(scores: np.ndarray, k: int) -> np.ndarray:
  """Rows of the `k` largest positive scores, best first; equal scores by row."""
  rows = np.flatnonzero(scores > 0)
  if len(rows) > k:  # Keep everything tied with the k-th score, then order exactly.
    kth = np.partition(scores[rows], len(rows) - k)[len(rows) - k]
    rows = rows[scores[rows] >= kth]
  return rows[np.lexsort((rows, -scores[rows]))][:k]


def _index(texts: Iterable[str], n: int, k1: float, b: float, show_progress: bool):
  """A bm25s model over `n` texts, tokenised like `search.tokenize`; None when n is 0."""
  import bm25s  # noqa: PLC0415 - see the module docstring

  if n == 0:
    return None
  tokenizer = bm25s.tokenization.Tokenizer(lower=True, splitter=_TOKEN_PATTERN, stopwords=None)
  # allow_empty=False: a document without words is an empty row, not a row of "". The
  # texts come with their own progress bar (bytes read) where they are read from a file.
  ids = tokenizer.tokenize(texts, length=n, return_as="ids", allow_empty=False,
                           show_progress=False)  # fmt: skip
  model = bm25s.BM25(k1=k1, b=b, method="lucene", idf_method="lucene")
  model.index((ids, tokenizer.get_vocab_dict()), create_empty_token=False,
              show_progress=show_progress)  # fmt: skip
  return model


def _manifest(corpus: str, k1: float, b: float) -> dict:
  stat = os.stat(corpus)
  return {"format": _FORMAT, "corpus": corpus, "bytes": stat.st_size,
          "mtime_ns": stat.st_mtime_ns, "k1": k1, "b": b, "tokens": _TOKEN_PATTERN}  # fmt: skip


def _indexes(saved: dict | None, manifest: dict) -> bool:
  """Whether a saved manifest is that of an index of `manifest`'s corpus and settings (it
  also says how many bad lines the index left out)."""
  return saved is not None and {k: v for k, v in saved.items() if k != "skipped"} == manifest


def _read_manifest(index_dir: str) -> dict | None:
  try:
    with open(os.path.join(index_dir, "manifest.json")) as f:
      return json.load(f)
  except (OSError, ValueError):
    return None


def _scan(corpus: str, offsets: list, ids: list, titles: list, show_progress: bool,
          skip: set[int] = frozenset()) -> Iterator[str]:  # fmt: skip
  """Yields each line's contents, recording its byte offset and key hashes on the way;
  lines numbered in `skip` (checked bad and left out) are passed over."""
  seen = set()
  with open(corpus, "rb") as f, tqdm.tqdm(total=os.path.getsize(corpus), unit="B",
                                          unit_scale=True, desc=f"Reading {corpus}",
                                          disable=not show_progress) as bar:  # fmt: skip
    offset = 0
    for number, line in enumerate(f, 1):
      if line.strip() and number not in skip:
        try:
          doc = from_record(json.loads(line), number)
        except json.JSONDecodeError as e:
          raise ValueError(f"{corpus} line {number} is not JSON: {e}") from None
        id_hash = _key_hash(doc.doc_id)
        if id_hash in seen:
          raise ValueError(f"{corpus} line {number}: document id {doc.doc_id!r} repeats.")
        seen.add(id_hash)
        offsets.append(offset)
        ids.append(id_hash)
        titles.append(_key_hash(doc.title.strip().lower()))
        yield f"{doc.title}\n{doc.text}"
      offset += len(line)
      bar.update(len(line))


def _build_and_save(corpus: str, index_dir: str, manifest: dict, show_progress: bool,
                    skip_invalid: bool = False) -> None:  # fmt: skip
  """Checks `corpus`, then indexes it into a fresh directory renamed to `index_dir` when
  complete."""
  start = time.perf_counter()
  problems = data_checks.Problems()
  skip = data_checks.check_corpus(corpus, problems)
  problems.finish(skip_invalid=skip_invalid)
  n = problems.total - len(skip)
  offsets, ids, titles = [], [], []
  model = _index(_scan(corpus, offsets, ids, titles, show_progress, skip), n, manifest["k1"],
                 manifest["b"], show_progress)  # fmt: skip
  keys = _Keys.build(ids, titles)
  tmp = f"{index_dir}.tmp-{uuid.uuid4().hex[:8]}"
  try:
    os.makedirs(tmp)
  except OSError as e:
    raise OSError(f"Cannot write the index of {corpus} to {index_dir} ({e}); "
                  "give retrieval.index_dir a writable directory.") from None
  np.save(os.path.join(tmp, "offsets.npy"), np.asarray(offsets, np.int64))
  for name, array in keys.arrays.items():
    np.save(os.path.join(tmp, f"{name}.npy"), array)
  if model is not None:
    model.save(os.path.join(tmp, "bm25s"), show_progress=False)
  with open(os.path.join(tmp, "manifest.json"), "w") as f:
    json.dump({**manifest, "skipped": len(skip)}, f)  # Last: without it, it is no index.
  if _indexes(_read_manifest(index_dir), manifest):  # Built meanwhile by another: keep theirs.
    shutil.rmtree(tmp, ignore_errors=True)
    return
  if os.path.exists(index_dir):  # Stale: moved aside first, so no reader sees it half-deleted.
    stale = f"{index_dir}.stale-{uuid.uuid4().hex[:8]}"
    os.rename(index_dir, stale)
    shutil.rmtree(stale, ignore_errors=True)
  try:
    os.rename(tmp, index_dir)
  except OSError:  # Another process renamed its build in first: keep theirs.
    shutil.rmtree(tmp, ignore_errors=True)
  logging.info("Indexed %d documents of %s in %.1f s into %s.", n, corpus,
               time.perf_counter() - start, index_dir)  # fmt: skip


# -------------------------------------------------------------------------------- HTTP


class _Malformed(ValueError):
  """A server's answer that is not Search-R1's JSON (a proxy's error page, a cut answer)."""


def is_transient(e: BaseException) -> bool:
  """Whether a failed request may succeed when repeated: a 5xx, 408 or 429, a connection
  refused, reset or cut, a timeout, a malformed answer. Another HTTP error (a 4xx) is the
  server's answer to this request."""
  if isinstance(e, urllib.error.HTTPError):
    return e.code >= 500 or e.code in (408, 429)
  return isinstance(e, (OSError, http.client.HTTPException, _Malformed))


class HttpRetriever:
  """A retriever server speaking Search-R1's API (`POST /retrieve`), e.g. its
  `retrieval_server.py` or FlashRAG's, over any corpus and any retriever (BM25, e5, ...).

  Request `{"queries": [q], "topk": k, "return_scores": true}`; answer
  `{"result": [[{"document": {"id", "contents"}, "score"}, ...]]}` (a list of documents
  without scores is accepted too). The API has no call to fetch one document, so `lookup`
  finds the documents of earlier results (the last `remember` of them), which is what a
  visit of a doc id from a search reply needs. A transient failure (5xx, 408, 429, a reset,
  a timeout, an answer that is not the API's JSON) is retried under `health`'s policy
  (`tool_health`: back-off with jitter, `ToolOutage` past `outage_s`); another HTTP error
  (a 4xx: the server refused this request) propagates, and the search tool turns it into
  an error message.
  """

  def __init__(self, url: str, *, timeout_s: float = 30.0, snippet_chars: int = 160,
               remember: int = 10_000, health: tool_health.Health | None = None,
               tool: str = "search"):
    if not url.startswith(("http://", "https://")):
      raise ValueError(f"Retriever URL must start with http:// or https://, got {url!r}.")
    self.url, self.timeout_s, self.tool = url, timeout_s, tool
    self.snippet_chars, self.remember = snippet_chars, remember
    self.health = health or tool_health.HEALTH
    self._seen: collections.OrderedDict[str, Document] = collections.OrderedDict()

  def _attempt(self, data: bytes, timeout_s: float) -> list:
    """One request; the answer's first result list (a malformed answer raises `_Malformed`)."""
    request = urllib.request.Request(self.url, data=data, method="POST",
                                     headers={"Content-Type": "application/json"})  # fmt: skip
    with urllib.request.urlopen(request, timeout=timeout_s) as response:
      raw = response.read()
    try:
      results = json.loads(raw)["result"][0]
      if not isinstance(results, list):
        raise TypeError(type(results).__name__)
    except (ValueError, KeyError, IndexError, TypeError) as e:
      raise _Malformed(f"the answer is not {{'result': [[...]]}} ({type(e).__name__}): "
                       f"{raw[:120]!r}") from None  # fmt: skip
    return results

  def search(self, query: str, k: int = 3) -> list[search.Hit]:
    """The server's top `k` documents for `query`, best first."""
    if k <= 0:
      return []
    data = json.dumps({"queries": [query], "topk": k, "return_scores": True}).encode("utf-8")
    results = self.health.request(self.tool, self.url, lambda t: self._attempt(data, t),
                                  transient=is_transient, timeout_s=self.timeout_s)  # fmt: skip
    terms, hits = search.tokenize(query), []
    for rank, item in enumerate(results[:k]):
      record = item.get("document", item) if isinstance(item, dict) else item
      doc = from_record(record)
      self._remember(doc)
      # No corpus statistics here: every query word weighs the same in the snippet.
      snippet = search.best_sentence(doc.text, terms, lambda t: 1.0, self.snippet_chars)
      # Without scores (return_scores false on the server) the rank orders the hits.
      score = item.get("score") if isinstance(item, dict) and "document" in item else None
      score = float(len(results) - rank) if score is None else float(score)
      hits.append(search.Hit(doc.doc_id, doc.title, snippet, score))
    return hits

  def _remember(self, doc: Document) -> None:
    for key in (doc.doc_id, doc.title.strip().lower()):
      self._seen[key] = doc
      self._seen.move_to_end(key)
    while len(self._seen) > 2 * self.remember:
      self._seen.popitem(last=False)

  def lookup(self, doc_id_or_title: str) -> Document | None:
    """A document of an earlier result, by id or title (any case); else None."""
    key = search.lookup_key(doc_id_or_title)
    return self._seen.get(key) or self._seen.get(key.lower())


def make_retriever(r, documents: Sequence[Document]) -> search.Retriever:
  """The retriever a config's `retrieval` block names (configs/common.py `retrieval`).

  backend "bm25s" with corpus "" indexes `documents` (the generated world) in memory; with a
  corpus path, that JSONL file (index in `index_dir`, default beside it). "http": `url`.
  """
  if r.backend == "bm25s":
    if not r.corpus:
      return Bm25Retriever.from_documents(documents, k1=r.k1, b=r.b)
    return Bm25Retriever.from_jsonl(r.corpus, index_dir=r.index_dir or None, k1=r.k1, b=r.b)
  if r.backend == "http":
    if not r.url:
      raise ValueError("retrieval.url must name the retriever server when "
                       "retrieval.backend='http' (e.g. http://127.0.0.1:8000/retrieve).")
    return HttpRetriever(r.url, timeout_s=r.timeout_s)
  raise ValueError(f"retrieval.backend must be 'bm25s' or 'http', got {r.backend!r}.")
