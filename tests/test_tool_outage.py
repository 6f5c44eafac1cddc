"""Tool health end to end on task=qa over a Search-R1 server on 127.0.0.1 (tests/fault_retriever):
a flaky retriever changes no score, a missing or stopped one ends the program with one line."""

import os
import pathlib
import subprocess
import sys
import time

import pytest

from configs import mgrpo
from mgrpo_jax import checkpoint as ckpt_lib
from mgrpo_jax import evaluate, metrics
from mgrpo_jax.envs import datasets, qa, tool_health
from mgrpo_jax.mgrpo import colocated

import fault_retriever

ROOT = pathlib.Path(__file__).resolve().parents[1]
MUSIQUE = str(ROOT / "tests" / "data" / "qa" / "musique.jsonl")
# 3 requests in 10 fail, each in another way; one answers late.
FLAKY = ["5xx", None, None, "reset", "slow", None, "malformed", None, None, None]


@pytest.fixture(scope="module")
def documents():
  return qa.corpus_documents(datasets.load_qa(MUSIQUE, "musique"))


def _qa(arg: str, url: str, **top):
  c = mgrpo.get_config(arg)
  c.data.update(format="musique", train=MUSIQUE, eval=MUSIQUE, corpus=url)
  c.update(top)
  return c


def test_expert_evaluation_scores_the_same_through_a_flaky_retriever(tmp_path, documents):
  with fault_retriever.FaultyRetriever(documents) as healthy:
    good = evaluate.run(_qa("task=qa,policy=expert", healthy.url), str(tmp_path / "a"))
  with fault_retriever.FaultyRetriever(documents, FLAKY, slow_s=0.05) as flaky:
    bad = evaluate.run(_qa("task=qa,policy=expert", flaky.url), str(tmp_path / "b"))
  assert good["accuracy"] >= 0.5
  assert (bad["accuracy"], bad["f1"], bad["retrieval_recall"]) == (
      good["accuracy"], good["f1"], good["retrieval_recall"])  # fmt: skip
  assert bad["tools/search/calls"] == good["tools/search/calls"] > 0
  assert good["tools/search/retries"] == 0
  assert bad["tools/search/retries"] == bad["tools/search/failures"] > 0
  assert 0.2 < bad["tools/search/failures"] / bad["tools/search/requests"] < 0.4


def _error_lines(proc):
  """stderr without absl's log lines ("I1126 ...", "W1126 ...")."""
  return [line for line in proc.stderr.splitlines()
          if line.strip() and not (line[:1] in "IWE" and line[1:5].isdigit())]


def test_evaluation_without_a_retriever_exits_with_one_line(tmp_path):
  url = f"http://127.0.0.1:{fault_retriever.free_port()}/retrieve"
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  proc = subprocess.run(
      [sys.executable, "launch/evaluate.py", "--config=configs/mgrpo.py:task=qa,policy=expert",
       "--config.data.format=musique", f"--config.data.eval={MUSIQUE}",
       f"--config.data.corpus={url}", "--config.tools.outage_s=2",
       f"--workdir={tmp_path / 'e'}"], cwd=ROOT, env=env, capture_output=True, text=True,
      timeout=300)  # fmt: skip
  assert proc.returncode == 1, proc.stderr[-2000:]
  assert "Traceback" not in proc.stderr and "accuracy" not in proc.stdout
  lines = _error_lines(proc)
  assert len(lines) <= 2, lines
  assert "ToolOutage: search: the service at " + url in lines[0]
  assert "outage_s=2" in lines[0] and "Connection refused" in lines[0]
  assert not (tmp_path / "e" / "eval.json").exists()


def test_a_retriever_stopped_mid_run_ends_it_and_a_restart_finishes_it(tmp_path, documents,
                                                                       monkeypatch):  # fmt: skip
  """Stopped once step 1's checkpoint is saved: the run ends in step 2 with nothing of it
  kept; restarted with the retriever back, it ends as the uninterrupted run does."""
  outage_s = 3.0

  def cfg(url):
    c = _qa("task=qa,smoke,policy=expert,variant=frozen_sub", url, num_steps=4, checkpoint_every=1)
    c.tools.outage_s = outage_s
    return c

  straight, stopped = str(tmp_path / "straight"), str(tmp_path / "stopped")
  with fault_retriever.FaultyRetriever(documents) as srv:
    colocated.train_and_evaluate(cfg(srv.url), straight)
    save, stopped_at = ckpt_lib.Checkpointer.save, []

    def save_then_stop(self, step, *args, **kw):
      out = save(self, step, *args, **kw)
      if step == 2:  # After step 1's update: its checkpoint.
        self.wait()
        srv.stop()
        stopped_at.append(time.monotonic())
      return out

    monkeypatch.setattr(ckpt_lib.Checkpointer, "save", save_then_stop)
    with pytest.raises(tool_health.ToolOutage) as e:
      colocated.train_and_evaluate(cfg(srv.url), stopped)
    assert time.monotonic() - stopped_at[0] < outage_s + 60
    monkeypatch.undo()
    message = str(e.value)
    assert "\n" not in message and srv.url in message and "outage_s=3" in message
    assert [m["step"] for m in metrics.read_metrics(stopped)] == [0, 1]  # Nothing of step 2.
    with ckpt_lib.Checkpointer(os.path.join(stopped, "checkpoints")) as ckpt:
      assert ckpt.latest_step() == 2
    srv.start()  # The same port again.
    colocated.train_and_evaluate(cfg(srv.url), stopped)
  a, b = metrics.stable(metrics.read_metrics(straight)), metrics.stable(
      metrics.read_metrics(stopped))  # fmt: skip
  assert [m["step"] for m in b] == [0, 1, 2, 3, 4]
  assert a == b
  assert all(m.get("tools/search/failures", 0) == 0 for m in a)
  assert {"main/loss", "tools/search/calls", "tools/delegate/calls"} <= set(a[1])
