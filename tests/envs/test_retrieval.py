"""Tests for the retrieval backends: bm25s in memory and over a saved JSONL index, and HTTP."""

import http.server
import json
import math
import os
import threading

import numpy as np
import pytest

from configs import mgrpo
from mgrpo_jax.mgrpo import tasks
from mgrpo_jax.agents import experts as ex
from mgrpo_jax.envs import retrieval, search, tool_health
from mgrpo_jax.envs.world import Document, WorldConfig, generate_world

import fault_retriever  # tests/fault_retriever.py: the retriever servers' JSON reply

# Titles are indexed with the text: doc a = [cat, cat, sat] (3 tokens), b = [dog, dog, sat, down]
# (4), c = [bird, bird] (2); avgdl = 3, N = 3.
_TINY = [Document("a", "Cat", "Cat sat."), Document("b", "Dog", "Dog sat down."),
         Document("c", "Bird", "Bird.")]  # fmt: skip


@pytest.fixture(scope="module")
def world():
  return generate_world(WorldConfig(seed=2, distractors_per_doc=3))


def test_bm25_matches_hand_computed_lucene_scores():
  index = retrieval.Bm25Retriever.from_documents(_TINY)  # k1 = 1.2, b = 0.75
  # idf(cat) = ln(1 + (3 - 1 + .5) / (1 + .5)) = ln(8/3) = 0.980829; in a: tf = 2, |a| = avgdl,
  # so the normaliser is k1 = 1.2 and the tf part 2 / 3.2 = 0.625.
  np.testing.assert_allclose(index.scores("cat"), [0.613018, 0, 0], atol=1e-6)
  # idf(sat) = ln(1 + 1.5 / 2.5) = ln(1.6) = 0.470004. In a: tf part 1 / 2.2. In b:
  # normaliser 1.2 * (0.25 + 0.75 * 4 / 3) = 1.5, tf part 1 / 2.5 = 0.4 -> 0.188002.
  np.testing.assert_allclose(index.scores("sat"), [0.213638, 0.188002, 0], atol=1e-6)
  # Terms add up; a repeated query word counts once; unknown words add nothing.
  np.testing.assert_allclose(index.scores("Cat SAT cat zebra"), [0.826656, 0.188002, 0],
                             atol=1e-6)  # fmt: skip
  assert index.idf("cat") == pytest.approx(math.log(8 / 3)) and index.idf("zebra") == 0.0


def test_search_ranks_breaks_ties_by_position_and_drops_zero_scores():
  index = retrieval.Bm25Retriever.from_documents(_TINY)
  hits = index.search("sat", k=3)
  assert [h.doc_id for h in hits] == ["a", "b"]
  assert hits[0].title == "Cat" and hits[0].score == pytest.approx(0.213638, abs=1e-6)
  assert index.search("sat", k=0) == [] and index.search("zebra") == []
  assert retrieval.Bm25Retriever.from_documents([]).search("cat") == []
  # Five equal documents: the first three, in order, whatever the partition does.
  same = retrieval.Bm25Retriever.from_documents(
      [Document(f"d{i}", "Same", "Same words.") for i in range(5)])
  assert [h.doc_id for h in same.search("words", k=3)] == ["d0", "d1", "d2"]
  with pytest.raises(ValueError, match="'a' repeats"):
    retrieval.Bm25Retriever.from_documents([_TINY[0], Document("a", "X", "y")])


def test_snippet_is_the_best_matching_sentence():
  doc = Document("d", "Lake", "The lake is cold. Boats float on the lake in summer. Fish swim.")
  index = retrieval.Bm25Retriever.from_documents([doc, Document("e", "Hill", "A hill, boats.")])
  assert index.search("summer boats")[0].snippet == "Boats float on the lake in summer."
  short = retrieval.Bm25Retriever.from_documents([doc], snippet_chars=20).search("summer")
  assert len(short[0].snippet) <= 20 and short[0].snippet.startswith("Boats")


def test_corpus_lines_round_trip(world, tmp_path):
  path = retrieval.export_corpus(world, str(tmp_path / "world.jsonl"))
  with open(path) as f:
    lines = [json.loads(line) for line in f]
  assert len(lines) == len(world.documents)
  first = world.documents[0]
  assert lines[0] == {"id": first.doc_id, "contents": f'"{first.title}"\n{first.text}'}
  assert [retrieval.from_record(r) for r in lines] == list(world.documents)
  with pytest.raises(ValueError, match="line 7"):
    retrieval.from_record({"id": "x"}, 7)


def test_jsonl_index_is_saved_memory_mapped_and_rebuilt_when_stale(world, tmp_path):
  path = retrieval.export_corpus(world, str(tmp_path / "world.jsonl"))
  built = retrieval.Bm25Retriever.from_jsonl(path, show_progress=False)
  index_dir = path + ".bm25s"
  assert os.path.exists(os.path.join(index_dir, "manifest.json"))
  memory = retrieval.Bm25Retriever.from_documents(world.documents)
  saved_at = os.stat(os.path.join(index_dir, "manifest.json")).st_mtime_ns
  loaded = retrieval.Bm25Retriever.from_jsonl(path)
  assert os.stat(os.path.join(index_dir, "manifest.json")).st_mtime_ns == saved_at  # Not rebuilt.
  assert isinstance(loaded.model.scores["data"], np.memmap)
  assert isinstance(loaded.docs.offsets, np.memmap)
  for entity in world.entities[:20]:
    np.testing.assert_array_equal(loaded.scores(entity.name), memory.scores(entity.name))
    assert loaded.search(entity.name) == memory.search(entity.name) == built.search(entity.name)
  doc = world.documents[7]
  assert loaded.lookup(f" [{doc.doc_id}] ") == doc == loaded.lookup(doc.title.upper())
  assert loaded.visit(doc.doc_id, max_chars=10_000) == doc.text
  assert loaded.lookup("no-such-doc") is None
  # A changed corpus is indexed again; an explicit index_dir holds the index instead.
  with open(path, "a") as f:
    f.write(json.dumps({"id": "new1", "contents": '"Zyx Qua"\nZyx Qua is new.'}) + "\n")
  assert retrieval.Bm25Retriever.from_jsonl(path).search("zyx")[0].doc_id == "new1"
  other = str(tmp_path / "elsewhere")
  assert retrieval.Bm25Retriever.from_jsonl(path, index_dir=other).lookup("new1").title == "Zyx Qua"
  assert os.path.exists(os.path.join(other, "manifest.json"))


def test_jsonl_errors_name_the_line(tmp_path):
  bad = tmp_path / "bad.jsonl"
  bad.write_text('{"id": "a", "contents": "A\\ntext"}\n\n{"id": "a", "contents": "B"}\n')
  with pytest.raises(ValueError, match="bad.jsonl:3: duplicate id 'a'"):
    retrieval.Bm25Retriever.from_jsonl(str(bad))
  bad.write_text('{"id": "a", "contents": "A"}\nnot json\n')
  with pytest.raises(ValueError, match="bad.jsonl:2: not valid JSON"):
    retrieval.Bm25Retriever.from_jsonl(str(bad))
  with pytest.raises(FileNotFoundError, match="does not exist"):
    retrieval.Bm25Retriever.from_jsonl(str(tmp_path / "missing.jsonl"))


def test_research_experts_solve_every_question_over_the_exported_world(tmp_path):
  """The demo's world, exported as a corpus and indexed from the file: every question of the
  noise-free experts (main + sub, and single) is answered right through the tools."""
  c = mgrpo.get_config()
  c.retrieval.corpus = retrieval.export_corpus(tasks.build_env(c).documents,
                                               str(tmp_path / "world.jsonl"))
  env = tasks.build_env(c)
  assert not isinstance(env.index.docs, list)  # Read from the file at saved offsets.
  kw = dict(search_k=c.world.search_k, max_chars=c.world.visit_chars)
  questions = env.train + env.test
  assert len(questions) == c.world.num_questions
  assert all(ex.solve(q, env.index, **kw)["correct"] for q in questions)
  assert all(ex.solve_single(q, env.index, **kw)["correct"] for q in questions)


# ---------------------------------------------------------------------------------- HTTP


class _SearchR1Stub(http.server.BaseHTTPRequestHandler):
  """Search-R1's POST /retrieve over an in-memory index; records the requests it gets."""

  def do_POST(self):  # noqa: N802 - the http.server hook's name
    body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
    self.server.requests.append((self.path, body))
    if self.server.fail:
      self.server.fail -= 1
      self.send_error(503)
      return
    results = []
    for query in body["queries"]:
      hits = self.server.index.search(query, body["topk"])
      docs = [retrieval.to_record(self.server.index.lookup(h.doc_id)) for h in hits]
      results.append([{"document": d, "score": h.score} for d, h in zip(docs, hits)]
                     if body["return_scores"] else docs)  # fmt: skip
    fault_retriever.send_json(self, json.dumps({"result": results}).encode())

  def log_message(self, *args):
    del args


@pytest.fixture
def server(world):
  srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _SearchR1Stub)  # A free port.
  srv.index, srv.requests, srv.fail = retrieval.Bm25Retriever.from_documents(world.documents), [], 0
  thread = threading.Thread(target=srv.serve_forever, args=(0.05,), daemon=True)
  thread.start()
  yield srv
  srv.shutdown()
  srv.server_close()


def test_http_backend_speaks_the_search_r1_api(world, server):
  url = f"http://127.0.0.1:{server.server_port}/retrieve"
  remote = retrieval.HttpRetriever(url)
  entity = world.entities[3]
  hits = remote.search(entity.name, k=2)
  assert server.requests == [("/retrieve", {"queries": [entity.name], "topk": 2,
                                            "return_scores": True})]  # fmt: skip
  local = server.index.search(entity.name, k=2)
  assert [(h.doc_id, h.title) for h in hits] == [(h.doc_id, h.title) for h in local]
  assert hits[0].snippet in world.document(hits[0].doc_id).text
  assert hits[0].score == pytest.approx(local[0].score, rel=1e-6)
  # Visit: the documents of earlier results, by id or title.
  assert remote.lookup(f"[{hits[0].doc_id}]") == world.document(hits[0].doc_id)
  assert remote.lookup(hits[1].title.lower()) == world.document(hits[1].doc_id)
  assert remote.lookup(world.entities[40].doc_id) is None  # Never in a result.


def test_http_backend_retries_failed_requests_unseen_by_the_agent(world, server):
  url = f"http://127.0.0.1:{server.server_port}/retrieve"
  server.fail = 1
  health = tool_health.Health(tool_health.Policy(outage_s=30, backoff_s=0.01))
  remote = retrieval.HttpRetriever(url, health=health)
  assert remote.search(world.entities[0].name, k=1)[0].doc_id == world.entities[0].doc_id
  assert len(server.requests) == 2  # One refused, one answered.
  server.fail = 3
  tools = search.local_tools(retrieval.HttpRetriever(url, health=health))
  assert tools["search"](world.entities[0].name).startswith(f"[{world.entities[0].doc_id}]")
  assert len(server.requests) == 6
  m = health.step_metrics()
  assert (m["tools/search/requests"], m["tools/search/retries"],
          m["tools/search/failures"]) == (6, 4, 4)  # fmt: skip
  with pytest.raises(ValueError, match="http:// or https://"):
    retrieval.HttpRetriever("localhost:8000")


def test_experts_solve_through_a_retriever_server(server):
  c = mgrpo.get_config()
  c.world.update(seed=2, distractors_per_doc=3)  # The server's world.
  c.retrieval.update(backend="http", url=f"http://127.0.0.1:{server.server_port}/retrieve")
  env = tasks.build_env(c)
  assert isinstance(env.index, retrieval.HttpRetriever)
  questions = env.test[:30]
  kw = dict(search_k=c.world.search_k, max_chars=c.world.visit_chars)
  assert all(ex.solve(q, env.index, **kw)["correct"] for q in questions)


def test_config_errors_name_the_field():
  c = mgrpo.get_config()
  c.retrieval.backend = "http"
  with pytest.raises(ValueError, match="retrieval.url"):
    tasks.build_env(c)
  c.retrieval.backend = "faiss"
  with pytest.raises(ValueError, match="retrieval.backend must be 'bm25s' or 'http'"):
    tasks.build_env(c)
