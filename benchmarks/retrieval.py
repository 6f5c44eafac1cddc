"""Retrieval: bm25s (envs/retrieval.py) against the hand-written BM25 it replaced.

  python benchmarks/retrieval.py --workdir=/data/scratch            # 100k and 1M documents
  python benchmarks/retrieval.py --docs=10000 --old_max_docs=10000  # a quick look

Synthetic corpora in the Search-R1 / FlashRAG layout (JSONL `{"id", "contents"}`, a two-word
title line, then about 100 words in sentences of 12, like wiki-18's 100-word passages):
a 200k-word vocabulary drawn with Zipf-Mandelbrot frequencies (p(rank) ~ 1 / (rank + 2.7)),
so common words are in most documents and most words in few. Queries are 1-4 words drawn
from the same law without its 100 commonest words (queries name things).

Each measurement runs in its own process, so its peak resident memory (`ru_maxrss`) is its
own: `bm25s build` reads, tokenises, indexes and saves the corpus (`Bm25Retriever.from_jsonl`
on a fresh index directory); `bm25s query` loads the saved index memory-mapped and answers
the queries; `old` reads the corpus into `Document`s and builds the hand-written index
(`SearchIndex` of mgrpo_jax/envs/search.py at commit OLD_COMMIT, read with `git show`), then
answers the same queries. A query is the search tool's whole call: top 3, snippets, titles.
The old index only runs up to --old_max_docs (its postings are Python dicts); above that
its numbers are extrapolated linearly from the largest size it ran, and marked so. The
machine this ran on has 2 cores shared with other jobs, so where both run the measurements
alternate (old, bm25s, old, bm25s, ...; --repeats rounds) and each figure is the best
round: both then saw the same background load.

Writes benchmarks/results/retrieval-cpu.json (with the command line).
"""

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
import types

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

OLD_COMMIT = "3f81b81"  # The last commit with the hand-written SearchIndex.
VOCAB, WORDS_PER_DOC, WORDS_PER_SENTENCE, K = 200_000, 100, 12, 3


def _words(rng: np.random.Generator, n: int) -> np.ndarray:
  """`n` distinct lower-case words of 3-10 letters."""
  out: dict[str, None] = {}
  letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
  while len(out) < n:
    for length in rng.integers(3, 11, size=n):
      out.setdefault("".join(rng.choice(letters, size=length)), None)
      if len(out) == n:
        break
  return np.array(list(out), dtype=object)


def _zipf_cdf(n: int) -> np.ndarray:
  p = 1.0 / (np.arange(n) + 2.7)
  return np.cumsum(p / p.sum())


def write_corpus(path: str, num_docs: int, seed: int = 0) -> None:
  """The synthetic corpus of `num_docs` documents (see the module docstring)."""
  rng = np.random.default_rng(seed)
  words, cdf = _words(rng, VOCAB), _zipf_cdf(VOCAB)
  tmp = path + ".tmp"
  with open(tmp, "w") as f:
    for start in range(0, num_docs, 10_000):  # In chunks: the word ids of 1M docs are 800 MB.
      n = min(10_000, num_docs - start)
      ids = np.minimum(np.searchsorted(cdf, rng.random((n, WORDS_PER_DOC + 2))), VOCAB - 1)
      for i, row in enumerate(words[ids]):
        title = f"{row[0].capitalize()} {row[1].capitalize()}"
        body = row[2:]
        sentences = [" ".join(body[j:j + WORDS_PER_SENTENCE]).capitalize() + "."
                     for j in range(0, len(body), WORDS_PER_SENTENCE)]  # fmt: skip
        f.write(json.dumps({"id": str(start + i), "contents": f'"{title}"\n' +
                            " ".join(sentences)}) + "\n")  # fmt: skip
  os.replace(tmp, path)


def queries(num: int, seed: int = 1) -> list[str]:
  rng = np.random.default_rng(seed)
  words, cdf = _words(np.random.default_rng(0), VOCAB), _zipf_cdf(VOCAB)
  out = []
  for length in rng.integers(1, 5, size=num):
    ranks = np.minimum(np.searchsorted(cdf, rng.uniform(cdf[99], 1.0, size=length)), VOCAB - 1)
    out.append(" ".join(words[ranks]))
  return out


def _peak_mb() -> float:
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux.


def _old_search_module():
  """mgrpo_jax/envs/search.py as of OLD_COMMIT, as a module (its SearchIndex)."""
  source = subprocess.check_output(["git", "show", f"{OLD_COMMIT}:mgrpo_jax/envs/search.py"],
                                   cwd=ROOT, text=True)  # fmt: skip
  module = types.ModuleType("old_search")
  sys.modules["old_search"] = module
  exec(compile(source, f"{OLD_COMMIT}:mgrpo_jax/envs/search.py", "exec"), module.__dict__)  # noqa: S102
  return module


def _answer(index, qs: list[str]) -> tuple[float, list[list[str]]]:
  index.search(qs[0], K)  # Warm: first-call imports and page faults.
  start = time.perf_counter()
  tops = [[h.doc_id for h in index.search(q, K)] for q in qs]
  return len(qs) / (time.perf_counter() - start), tops


def child(kind: str, corpus: str, index_dir: str, num_queries: int) -> dict:
  """One measurement, in this process (see the module docstring)."""
  import bm25s  # noqa: F401, PLC0415 - and with it JAX, loaded in every program of this repo
  from mgrpo_jax.envs import retrieval  # noqa: PLC0415

  base = _peak_mb()  # Python, NumPy and JAX: the same for all three kinds.
  qs = queries(num_queries)
  start = time.perf_counter()
  if kind == "bm25s_build":
    retrieval.Bm25Retriever.from_jsonl(corpus, index_dir=index_dir, show_progress=False)
    return {"build_s": time.perf_counter() - start, "peak_rss_mb": _peak_mb(),
            "base_rss_mb": base}  # fmt: skip
  if kind == "bm25s_query":
    index = retrieval.Bm25Retriever.from_jsonl(corpus, index_dir=index_dir)
    load_s = time.perf_counter() - start
    qps, tops = _answer(index, qs)
    return {"load_s": load_s, "queries_per_s": qps, "peak_rss_mb": _peak_mb(),
            "base_rss_mb": base, "tops": tops}  # fmt: skip
  assert kind == "old", kind
  old = _old_search_module()
  with open(corpus) as f:
    docs = [retrieval.from_record(json.loads(line)) for line in f]
  read_s = time.perf_counter() - start
  index = old.SearchIndex(docs)
  build_s = time.perf_counter() - start
  qps, tops = _answer(index, qs)
  return {"read_s": read_s, "build_s": build_s, "queries_per_s": qps,
          "peak_rss_mb": _peak_mb(), "base_rss_mb": base, "tops": tops}  # fmt: skip


def _run_child(kind, corpus, index_dir, num_queries) -> dict:
  out = subprocess.run([sys.executable, __file__, f"--child={kind}", f"--corpus={corpus}",
                        f"--index_dir={index_dir}", f"--queries={num_queries}"],
                       check=True, capture_output=True, text=True).stdout  # fmt: skip
  return json.loads(out.strip().splitlines()[-1])


def _best(results: list[dict]) -> dict:
  """Per field, the best round (least time and memory, most queries/s); all rounds listed."""
  out = {}
  for key in results[0]:
    if key == "tops":
      continue
    values = [r[key] for r in results]
    out[key] = max(values) if key == "queries_per_s" else min(values)
    out[f"{key}_rounds"] = values
  return out


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--docs", default="100000,1000000", help="Corpus sizes, comma-separated.")
  p.add_argument("--old_max_docs", type=int, default=100_000,
                 help="Largest corpus the old BM25 indexes (bigger ones are extrapolated).")
  p.add_argument("--queries", type=int, default=1000)
  p.add_argument("--repeats", type=int, default=3, help="Rounds where both indexes run.")
  p.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "retrieval_bench"),
                 help="Corpora and indexes (1M documents: ~0.8 GB of JSONL, ~0.6 GB index).")
  p.add_argument("--out", default=os.path.join(ROOT, "benchmarks/results/retrieval-cpu.json"))
  p.add_argument("--child", default="", help=argparse.SUPPRESS)
  p.add_argument("--corpus", default="", help=argparse.SUPPRESS)
  p.add_argument("--index_dir", default="", help=argparse.SUPPRESS)
  args = p.parse_args()
  if args.child:
    print(json.dumps(child(args.child, args.corpus, args.index_dir, args.queries)))
    return

  os.makedirs(args.workdir, exist_ok=True)
  rows, last_old = [], None
  for n in [int(x) for x in args.docs.split(",")]:
    corpus = os.path.join(args.workdir, f"synthetic-{n}.jsonl")
    if not os.path.exists(corpus):
      start = time.perf_counter()
      write_corpus(corpus, n)
      print(f"wrote {corpus} in {time.perf_counter() - start:.0f} s", flush=True)
    index_dir = os.path.join(args.workdir, f"synthetic-{n}.bm25s")
    row = {"docs": n, "corpus_mb": os.path.getsize(corpus) / 2**20}
    runs = {"bm25s_build": [], "bm25s_query": [], "old": []}
    with_old = n <= args.old_max_docs
    for _ in range(args.repeats if with_old else 1):
      if with_old:
        runs["old"].append(_run_child("old", corpus, index_dir, args.queries))
      subprocess.run(["rm", "-rf", index_dir], check=True)  # A fresh build every round.
      runs["bm25s_build"].append(_run_child("bm25s_build", corpus, index_dir, args.queries))
      runs["bm25s_query"].append(_run_child("bm25s_query", corpus, index_dir, args.queries))
    row["index_mb"] = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(index_dir)
                          for f in fs) / 2**20  # fmt: skip
    row["rounds"] = len(runs["bm25s_build"])
    bm25s_tops = runs["bm25s_query"][0]["tops"]
    for kind, results in runs.items():
      if results:
        row[kind] = _best(results)
    if with_old:
      # The same formula: the rankings agree, up to the order of float32 vs float64 ties.
      row["old"]["same_top3"] = float(np.mean([a == b for a, b in
                                               zip(runs["old"][0]["tops"], bm25s_tops)]))
      last_old = (n, row["old"])
    elif last_old is not None:
      m, old = last_old
      scale = n / m  # Postings, dicts and per-query work all grow with the corpus.
      row["old_extrapolated"] = {
          "from_docs": m, "build_s": old["build_s"] * scale,
          "peak_rss_mb": old["base_rss_mb"] + (old["peak_rss_mb"] - old["base_rss_mb"]) * scale,
          "queries_per_s": old["queries_per_s"] / scale}  # fmt: skip
    rows.append(row)
    print(json.dumps(row, default=str), flush=True)

  commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, text=True,
                          capture_output=True).stdout.strip()
  result = {"benchmark": "retrieval", "device": "cpu", "platform": platform.platform(),
            "code_commit": commit,
            "cpu_count": os.cpu_count(), "command": " ".join(["python"] + sys.argv),
            "old_commit": OLD_COMMIT, "queries": args.queries, "top_k": K,
            "note": "2 CPU cores shared with 4 other agents' jobs: times vary by 2-5x between "
                    "rounds; compare the alternating rounds of one row, not across rows.",
            "words_per_doc": WORDS_PER_DOC, "vocabulary": VOCAB, "rows": rows}  # fmt: skip
  os.makedirs(os.path.dirname(args.out), exist_ok=True)
  with open(args.out, "w") as f:
    json.dump(result, f, indent=1)
  print(f"wrote {args.out}")


if __name__ == "__main__":
  main()
