"""Real multi-hop QA as a task (task=qa): its corpus, its retriever, and how it is scored.

The questions come from `datasets.load_qa` (MuSiQue, HotpotQA, or any JSONL of questions and
answers). The corpus the search tool searches is, by `config.data.corpus`: "" the data
files' own paragraphs (gold and distractors of every record, deduplicated by title and
text: the Search-R1 recipe for an offline stand-in of web search); a path, an `{id,
contents}` JSONL corpus (envs/retrieval.py's format); or an http(s) URL, a Search-R1
`/retrieve` server. Scores are SQuAD's: exact match and token F1 after the standard answer
normalisation, the best over the answer and its aliases (`rl.rewards`). Retrieval recall
asks, per hop of the gold structure, whether a search showed the hop's supporting paragraph.
"""

from __future__ import annotations

import hashlib
from typing import Iterable, Sequence

from mgrpo_jax.envs import data_checks, datasets, retrieval
from mgrpo_jax.envs import search as search_lib
from mgrpo_jax.envs.datasets import Paragraph, QAQuestion
from mgrpo_jax.envs.world import Document
from mgrpo_jax.rl import rewards



def doc_id(p: Paragraph) -> str:
  """A paragraph's id in the data corpus: stable across files (a hash of title and text)."""
  title, text = p.key
  return "d" + hashlib.blake2b(f"{title}\n{text}".encode(), digest_size=4).hexdigest()


def corpus_documents(questions: Iterable[QAQuestion]) -> tuple[Document, ...]:
  """The questions' paragraphs as documents, deduplicated by title and text, in first-seen order."""
  seen: dict[tuple[str, str], Document] = {}
  for q in questions:
    for p in q.paragraphs:
      if p.key not in seen:
        seen[p.key] = Document(doc_id(p), p.title, p.text)
  ids = [d.doc_id for d in seen.values()]
  if len(set(ids)) != len(ids):  # 32-bit ids: a collision needs ~65k paragraphs to be likely.
    raise ValueError("two paragraphs of the data share a doc id; report this")
  return tuple(seen.values())


def is_url(corpus: str) -> bool:
  return corpus.startswith(("http://", "https://"))


def make_retriever(corpus: str, r, questions: Sequence[QAQuestion], *,
                   skip_invalid: bool = False) -> tuple[
    search_lib.Retriever, tuple[Document, ...]]:  # fmt: skip
  """The retriever over `corpus` (`config.data.corpus`), with `r` the config's `retrieval`
  block (how to search: BM25's k1 and b, the index directory, the server's timeout), and the
  documents it holds where they are known here (the data corpus's; else empty). A JSONL
  corpus's bad lines raise, or with `skip_invalid` are left out of its index."""
  if not corpus:
    docs = corpus_documents(questions)
    if not docs:
      raise ValueError("config.data.corpus='' means the data files' paragraphs, but these "
                       "questions have none (a 'jsonl' dataset): name a corpus in "
                       "config.data.corpus (a JSONL file or a Search-R1 URL).")
    return retrieval.Bm25Retriever.from_documents(docs, k1=r.k1, b=r.b), docs
  if is_url(corpus):
    return retrieval.HttpRetriever(corpus, timeout_s=r.timeout_s), ()
  return retrieval.Bm25Retriever.from_jsonl(corpus, index_dir=r.index_dir or None, k1=r.k1,
                                            b=r.b, show_progress=False,
                                            skip_invalid=skip_invalid), ()  # fmt: skip


def load_data(d, r) -> tuple[list[QAQuestion], list[QAQuestion], search_lib.Retriever,
                             tuple[Document, ...]]:  # fmt: skip
  """`config.data`'s questions (train, eval) and the retriever over its corpus (`r`: the
  `retrieval` block), every record checked before any training: the question files',
  then the corpus's lines, then that each hop's supporting paragraph is in a JSONL corpus
  (a document of its title). Bad records raise one `DataErrors` per stage naming each, or
  with `d.skip_invalid` are left out (a config from before the field: False)."""
  skip = bool(d.get("skip_invalid", False))
  problems, where = data_checks.Problems(), {}
  read = lambda path: datasets.read_qa(path, d.format, problems, fields=dict(d.fields),
                                       where_of=where) if path else []  # fmt: skip
  train, test = read(d.train), read(d.eval)
  problems.finish(skip_invalid=skip)
  for path, questions in ((d.train, train), (d.eval, test)):
    if path and not questions:
      raise datasets.DatasetError(f"{path}: no usable {d.format} questions")
  index, documents = make_retriever(d.corpus, r, train + test, skip_invalid=skip)
  if d.corpus and not is_url(d.corpus):  # The data's own corpus holds them by construction.
    problems = data_checks.Problems()
    train, test = (_supported(q, index, d.corpus, where, problems) for q in (train, test))
    problems.finish(skip_invalid=skip)
  return train, test, index, documents


def _supported(questions, index, corpus: str, where: dict, problems) -> list[QAQuestion]:
  """The questions each of whose hops has a supporting paragraph's title in the corpus."""
  kept = []
  for q in questions:
    problems.read(where[q.id].rpartition(":")[0] or where[q.id])
    missing = [(n, hop.support[0].title) for n, hop in enumerate(q.hops, 1)
               if hop.support and not any(_has_title(index, p.title) for p in hop.support)]
    if missing:
      n, title = missing[0]
      problems.add(where[q.id], f"question {q.id!r}: hop {n}'s supporting paragraph "
                   f"{title!r} is not in the corpus {corpus} (no document of that title)")
    else:
      kept.append(q)
  return kept


def _has_title(index: search_lib.Retriever, title: str) -> bool:
  """Whether `index` holds a document titled `title` (any case)."""
  keys = getattr(index, "keys", None)
  if keys is None:
    return index.lookup(title) is not None
  want = title.strip().lower()
  return any(index.docs[int(row)].title.strip().lower() == want
             for row in keys.rows("title", want))


def scores(prediction: str | None, q: QAQuestion) -> tuple[float, float]:
  """(exact match, token F1) of a prediction against the answer and its aliases (None: 0, 0)."""
  if prediction is None:
    return 0.0, 0.0
  return float(rewards.exact_match(prediction, q.answers)), rewards.best_f1(prediction, q.answers)


def hit_ids(search_replies: Iterable[str]) -> list[str]:
  """Doc ids of the "[doc_id] Title: snippet" lines of search replies (`search.format_hits`)."""
  return [line[1:line.index("]")] for reply in search_replies for line in reply.splitlines()
          if line.startswith("[") and "]" in line]  # fmt: skip


def searched_doc_ids(episodes: Iterable) -> list[str]:
  """Doc ids shown by the search replies of episodes (sub-agent or single-agent ones)."""
  return hit_ids(reply for ep in episodes for action, reply in zip(ep.actions, ep.observations)
                 if action == "search")


def hop_recall(q: QAQuestion, doc_ids: Iterable[str], index: search_lib.Retriever) -> list[bool]:
  """Per hop of `q`: did any of `doc_ids` (what the searches showed) hold a supporting paragraph?

  Documents are compared by title and text, so any corpus (the data's, a user's JSONL, a
  server's) is judged alike.
  """
  found = set()
  for i in dict.fromkeys(doc_ids):
    doc = index.lookup(i)
    if doc is not None:
      found.add(Paragraph(doc.title, doc.text).key)
  return [any(p.key in found for p in hop.support) for hop in q.hops]


def recall_metrics(prefix: str, questions: Sequence[QAQuestion], per_question_ids,
                   index: search_lib.Retriever) -> dict:  # fmt: skip
  """`{prefix}/retrieval_recall` over every hop and `..._hop<n>` for the n-th hops."""
  by_hop: dict[int, list[bool]] = {}
  for q, ids in zip(questions, per_question_ids):
    for n, hit in enumerate(hop_recall(q, ids, index), start=1):
      by_hop.setdefault(n, []).append(hit)
  every = [h for hits in by_hop.values() for h in hits]
  if not every:
    return {}
  m = {f"{prefix}/retrieval_recall": sum(every) / len(every)}
  m.update({f"{prefix}/retrieval_recall_hop{n}": sum(h) / len(h)
            for n, h in sorted(by_hop.items())})
  return m


def without_support(documents: Iterable[Document],
                    questions: Iterable[QAQuestion]) -> list[Document]:
  """`documents` less every supporting paragraph of `questions` (the leakage check's corpus)."""
  gold = {p.key for q in questions for h in q.hops for p in h.support}
  return [d for d in documents if Paragraph(d.title, d.text).key not in gold]


def eval_metrics(prefix: str, questions: Sequence[QAQuestion], episodes, sub_episodes,
                 index: search_lib.Retriever) -> dict:  # fmt: skip
  """`{prefix}/f1` of the answers (0 for an invalid episode) and the retrieval recall of the
  supporting paragraphs per hop, over what the searches of each question's episodes showed.

  `episodes` are the lead agent's, one per question in order (`.q` is the question's
  index); sub-agent episodes are matched to their question by `.q`.
  """
  f1 = [scores(ep.final if ep.format_ok else None, questions[ep.q])[1] for ep in episodes]
  shown: list[list[str]] = [[] for _ in questions]
  for ep in list(episodes) + list(sub_episodes):
    shown[ep.q] += searched_doc_ids([ep])
  m = {f"{prefix}/f1": sum(f1) / max(len(f1), 1)}
  m.update(recall_metrics(prefix, questions, shown, index))
  return m
