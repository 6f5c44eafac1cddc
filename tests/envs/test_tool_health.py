"""Tool health against real faults: a retriever on 127.0.0.1 failing on a schedule, a broken
sandbox."""

import time

import pytest

from mgrpo_jax import sandbox
from mgrpo_jax.envs import python_tool, retrieval, search, tool_health
from mgrpo_jax.envs.world import WorldConfig, generate_world

import fault_retriever


@pytest.fixture(scope="module")
def world():
  return generate_world(WorldConfig(seed=2, distractors_per_doc=3))


def _health(**kw):
  return tool_health.Health(tool_health.Policy(**{"outage_s": 20.0, "backoff_s": 0.01, **kw}))


@pytest.mark.parametrize("kind", ["5xx", "reset", "hang", "malformed"])
def test_a_transient_failure_is_retried_and_the_agent_sees_the_hits(world, kind):
  entity = world.entities[3]
  with fault_retriever.FaultyRetriever(world.documents, [kind, None, None], hang_s=3.0) as srv:
    health = _health()
    remote = retrieval.HttpRetriever(srv.url, timeout_s=0.5, health=health)
    tool_health.configure()
    reply = search.SearchTool(remote, k=2)(entity.name)
    assert reply.startswith(f"[{entity.doc_id}]")  # No trace of the failure in the reply.
    assert [k for _, k in srv.requests] == [kind, None]
  m = health.step_metrics()
  assert (m["tools/search/requests"], m["tools/search/retries"],
          m["tools/search/failures"]) == (2, 1, 1)  # fmt: skip
  calls = tool_health.step_metrics()
  assert calls["tools/search/calls"] == 1 and calls["tools/search/errors"] == 0
  assert calls["time/tools/search/latency_ms_p50"] > 0
  assert health.step_metrics() == {}  # A new step counts from zero.


def test_a_slow_answer_is_no_failure(world):
  with fault_retriever.FaultyRetriever(world.documents, ["slow"], slow_s=0.3) as srv:
    health = _health()
    hits = retrieval.HttpRetriever(srv.url, timeout_s=5.0, health=health).search("river", 2)
  assert hits and len(srv.requests) == 1
  m = health.step_metrics()
  assert (m["tools/search/retries"], m["tools/search/failures"]) == (0, 0)


def test_a_service_down_past_outage_s_stops_with_one_line_naming_the_url(world):
  with fault_retriever.FaultyRetriever(world.documents, ["5xx"]) as srv:
    health = _health(outage_s=1.5, backoff_s=0.05, max_backoff_s=0.2)
    tool = search.SearchTool(retrieval.HttpRetriever(srv.url, health=health))
    start = time.monotonic()
    with pytest.raises(tool_health.ToolOutage) as e:
      tool("anything")
    took = time.monotonic() - start
    assert 1.5 <= took < 3.0
    assert 5 <= len(srv.requests) <= 40  # Backed off: a bounded number of requests.
  message = str(e.value)
  assert "\n" not in message and srv.url in message and "HTTPError: HTTP Error 503" in message
  assert message.startswith("search: the service at") and "outage_s=1.5" in message


def test_a_refused_connection_is_an_outage_too():
  url = f"http://127.0.0.1:{fault_retriever.free_port()}/retrieve"
  health = _health(outage_s=0.5, backoff_s=0.05)
  with pytest.raises(tool_health.ToolOutage, match="ConnectionRefusedError|URLError"):
    retrieval.HttpRetriever(url, health=health).search("anything")
  assert health.step_metrics()["tools/search/failures"] >= 2


def test_a_hanging_service_is_abandoned_at_the_deadline(world):
  with fault_retriever.FaultyRetriever(world.documents, ["hang"], hang_s=10.0) as srv:
    health = _health(outage_s=1.0)
    start = time.monotonic()
    with pytest.raises(tool_health.ToolOutage, match="TimeoutError|timed out"):
      retrieval.HttpRetriever(srv.url, timeout_s=30.0, health=health).search("anything")
    assert time.monotonic() - start < 2.5  # Not timeout_s: the deadline cuts the attempt.


def test_an_error_rate_past_the_limit_stops_the_step(world):
  # 2 of 3 requests fail: every call succeeds after retries, but the service is sick.
  with fault_retriever.FaultyRetriever(world.documents, ["5xx", "5xx", None]) as srv:
    health = _health(max_error_rate=0.5, min_requests=9)
    remote = retrieval.HttpRetriever(srv.url, health=health)
    remote.search("river", 1)
    remote.search("river", 1)
    health.check_error_rate()  # 6 requests: too few to judge.
    remote.search("river", 1)
    with pytest.raises(tool_health.ToolOutage, match=r"failed 6 of 9 requests in this step "
                       r"\(config.tools.max_error_rate=0.5\)") as e:  # fmt: skip
      health.check_error_rate()
    assert srv.url in str(e.value)
    health.step_metrics()  # The next step starts clean.
    health.check_error_rate()


def test_30_percent_failures_pass_the_default_limit(world):
  schedule = ["5xx", None, None, "reset", None, None, "malformed", None, None, None]
  with fault_retriever.FaultyRetriever(world.documents, schedule) as srv:
    health = _health(min_requests=1)
    remote = retrieval.HttpRetriever(srv.url, health=health)
    for e in world.entities[:20]:
      assert remote.search(e.name, 1)[0].doc_id == e.doc_id
    health.check_error_rate()
  m = health.step_metrics()
  assert m["tools/search/failures"] == m["tools/search/retries"] > 0
  assert m["tools/search/requests"] == 20 + m["tools/search/retries"]


def test_a_4xx_is_the_servers_answer_not_retried(world, monkeypatch):
  with fault_retriever.FaultyRetriever(world.documents) as srv:
    health = _health()
    tool = search.SearchTool(retrieval.HttpRetriever(srv.url.replace("/retrieve", "/nope"),
                                                     health=health))  # fmt: skip
    monkeypatch.setattr(fault_retriever._Handler, "do_POST",
                        lambda self: self.send_error(404))  # fmt: skip
    assert tool("anything") == "Error: search failed (HTTPError)."
  m = health.step_metrics()
  assert (m["tools/search/requests"], m["tools/search/failures"]) == (1, 1)


def test_tool_errors_and_no_hits_are_replies(world):
  tool_health.configure()
  index = retrieval.Bm25Retriever.from_documents(world.documents)
  tools = search.local_tools(index)
  assert tools["search"]("zzzz qqqq") == "No results found."
  assert tools["visit"]("doc-that-is-not").startswith("Error: no document")
  m = tool_health.step_metrics()
  assert (m["tools/search/calls"], m["tools/search/errors"]) == (1, 0)
  assert (m["tools/visit/calls"], m["tools/visit/errors"]) == (1, 1)
  assert "tools/search/requests" not in m  # A local index makes no requests.


def test_a_broken_sandbox_is_retried_then_an_outage(monkeypatch):
  calls = []

  def broken(code, **kw):
    calls.append(code)
    if len(calls) < 3:
      raise sandbox.SandboxError("all 64 sandbox uids are in use")
    return sandbox.SandboxResult(ok=True, status="ok", returncode=0, stdout="4\n", stderr="",
                                 wall_s=0.0, cpu_s=0.0, truncated=False, isolation=())

  monkeypatch.setattr(sandbox, "run", broken)
  tool_health.configure()
  tool = python_tool.PythonTool(health=_health())
  assert tool("print(2 + 2)") == "4" and len(calls) == 3
  monkeypatch.setattr(sandbox, "run", lambda code, **kw: (_ for _ in ()).throw(
      sandbox.SandboxError("sandbox setup failed: no uids")))
  tool = python_tool.PythonTool(health=_health(outage_s=0.3))
  with pytest.raises(tool_health.ToolOutage, match="python: the service at the sandbox"):
    tool("print(1)")
  assert tool_health.step_metrics()["tools/python/calls"] == 1  # The outage is no reply.


def test_tools_config_is_checked_and_optional():
  from configs import mgrpo
  from mgrpo_jax import config_checks

  c = mgrpo.get_config()
  assert tool_health.policy_from_config(c) == tool_health.Policy(outage_s=300.0,
                                                                 max_error_rate=0.5)
  c.tools.max_error_rate = 1.5
  with pytest.raises(config_checks.ConfigValueError, match="config.tools.max_error_rate=1.5"):
    tool_health.policy_from_config(c)
  del c["tools"]  # A run's config.json from before the block.
  assert tool_health.policy_from_config(c) == tool_health.Policy()


def test_on_many_processes_process_0s_outcome_is_everyones(monkeypatch):
  """Simulated as process 1 of 2: its own outage is an error reply (replaced by process 0's
  replies), and process 0's outage is raised here too, at the same point."""
  from mgrpo_jax import distributed

  monkeypatch.setattr(tool_health.jax, "process_count", lambda: 2)
  monkeypatch.setattr(distributed, "is_primary", lambda: False)

  def down(query, k=3):
    raise tool_health.ToolOutage("search: the service at http://x failed for 9 s")

  index = type("Down", (), {"search": staticmethod(down), "lookup": lambda self, key: None})()
  tool_health.configure()
  assert search.SearchTool(index)("q") == "Error: search is unavailable."
  sent = []
  monkeypatch.setattr(distributed, "broadcast_object",
                      lambda obj: sent.append(obj) or ("ok", ["process 0's reply"]))
  assert tool_health.shared_outcome(lambda: (_ for _ in ()).throw(
      tool_health.ToolOutage("here only"))) == ["process 0's reply"]
  assert sent == [("outage", "here only")]
  monkeypatch.setattr(distributed, "broadcast_object", lambda obj: ("outage", "at process 0"))
  with pytest.raises(tool_health.ToolOutage, match="at process 0"):
    tool_health.shared_outcome(lambda: ["my reply"])
  # The error-rate verdict too: process 0's, whatever this process counted (nothing here).
  monkeypatch.setattr(distributed, "broadcast_object", lambda verdict: "search: at process 0")
  with pytest.raises(tool_health.ToolOutage, match="^search: at process 0$"):
    tool_health.check_error_rate()
