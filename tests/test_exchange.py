"""Exchange: round trips, exactly-once under races and SIGKILL, corruption and timeouts by key."""

import json
import random
import signal
import subprocess
import sys
import threading
import time
import uuid

import numpy as np
import pytest

from mgrpo_jax import exchange as xc


@pytest.fixture(params=["memory", "file"])
def ex(request, tmp_path):
  if request.param == "memory":  # A fresh path: memory:// is shared by the whole process.
    return xc.Exchange({"driver": "memory", "path": f"t-{uuid.uuid4().hex}"}, run="r1")
  return xc.Exchange(f"file://{tmp_path}/store", run="r1")


def test_records_round_trip(ex):
  rec = {"subtask": "Find the capital of Peru.", "ids": [3, 1, 4], "version": 7, "x": 0.1}
  assert ex.put("request", (2, 1, 3, 0), rec)
  assert ex.get("request", (2, 1, 3, 0), timeout_s=1) == rec
  assert ex.try_get("request", (2, 1, 3, 1)) is None
  assert ex.put("request", (2, 1, 3, 0), dict(rec)) is False  # Idempotent re-put.
  with pytest.raises(xc.ExchangeConflict, match="r1/request/00000002/0001/0003/0000") as e:
    ex.put("request", (2, 1, 3, 0), {**rec, "version": 8})
  assert e.value.existing == rec
  assert ex.get("request", (2, 1, 3, 0)) == rec  # The first record stands.


def test_file_layout_is_zero_padded(tmp_path):
  ex = xc.Exchange(str(tmp_path), run="exp/seed0")  # A plain path means file://.
  ex.put("result", (12, 3, 0, 5), {"text": "ok"})
  ex.put("outcome", (12,), {"n": 1})
  assert (tmp_path / "exp/seed0/result/00000012/0003/0000/0005.json").is_file()
  assert (tmp_path / "exp/seed0/outcome/00000012.json").is_file()
  stored = json.loads((tmp_path / "exp/seed0/result/00000012/0003/0000/0005.json").read_text())
  assert stored["v"] == xc.SCHEMA_VERSION and stored["record"] == {"text": "ok"}
  assert stored["key"] == "exp/seed0/result/00000012/0003/0000/0005.json"


def test_bad_keys_and_names_are_refused(ex):
  for key in [(), (-1,), (1, 2, 3, 4, 5), ("1",), (1.0,), (None,)]:
    with pytest.raises(ValueError):
      ex.put("request", key, {})
  for kind in ["", "a/b", "_mark", "a.b"]:
    with pytest.raises(ValueError):
      ex.put(kind, (0,), {})
  with pytest.raises(ValueError):  # NaN is not JSON.
    ex.put("request", (0,), {"r": float("nan")})


def test_list_by_prefix(ex):
  keys = [(1, 0, 0, 0), (1, 0, 1, 0), (1, 1, 0, 2), (10, 0, 0, 0), (2, 0, 0, 0)]
  for k in reversed(keys):
    ex.put("result", k, {"k": list(k)})
  ex.put("result", (1,), {"summary": True})  # A shorter key beside deeper ones.
  ex.put("other", (1, 0, 0, 0), {})
  assert ex.list("result", (1,)) == [(1,), (1, 0, 0, 0), (1, 0, 1, 0), (1, 1, 0, 2)]
  assert ex.list("result", (1, 0)) == [(1, 0, 0, 0), (1, 0, 1, 0)]
  assert ex.list("result", (10,)) == [(10, 0, 0, 0)]
  assert ex.list("result") == sorted(keys + [(1,)])
  assert ex.list("missing") == []
  assert ex.list("result", (np.int64(2),)) == [(2, 0, 0, 0)]


def test_get_timeout_lists_every_missing_key(ex):
  ex.put("result", (3, 0, 0, 0), {"text": "here"})
  keys = [(3, 0, 0, 0), (3, 0, 1, 0), (3, 1, 0, 2)]
  t0 = time.monotonic()
  with pytest.raises(xc.ExchangeTimeout) as e:
    ex.get_many("result", keys, timeout_s=0.2, poll_s=0.02)
  assert 0.2 <= time.monotonic() - t0 < 2
  msg = str(e.value)
  assert "r1/result/00000003/0000/0001/0000.json" in msg
  assert "r1/result/00000003/0001/0000/0002.json" in msg
  assert "0000/0000/0000.json" not in msg and "2 of 3" in msg
  assert len(e.value.missing) == 2
  with pytest.raises(TimeoutError):  # Also a builtin TimeoutError.
    ex.get("result", (9, 0, 0, 0), timeout_s=0)


def test_reader_waits_for_writer(ex):
  got = {}
  reader = threading.Thread(
      target=lambda: got.update(r=ex.get_many("result", [(0, 0), (0, 1)], timeout_s=10)))
  reader.start()
  time.sleep(0.1)
  ex.put("result", (0, 1), {"b": 2})
  time.sleep(0.1)
  assert reader.is_alive() and not got  # One of two is not a batch.
  ex.put("result", (0, 0), {"a": 1})
  reader.join(5)
  assert got["r"] == [{"a": 1}, {"b": 2}]


def test_threads_race_exactly_one_wins(ex):
  n_threads, n_keys = 8, 20
  outcomes = [[] for _ in range(n_keys)]
  barrier = threading.Barrier(n_threads)

  def writer(t):
    barrier.wait()
    for k in range(n_keys):
      try:
        outcomes[k].append((t, ex.put("result", (k,), {"writer": t})))
      except xc.ExchangeConflict as e:
        outcomes[k].append((t, e.existing))

  threads = [threading.Thread(target=writer, args=(t,)) for t in range(n_threads)]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  for k, outs in enumerate(outcomes):
    winners = [t for t, o in outs if o is True]
    assert len(winners) == 1, outs
    assert all(o == {"writer": winners[0]} for t, o in outs if o is not True)
    assert ex.get("result", (k,)) == {"writer": winners[0]}


def test_identical_racers_all_succeed_once(ex):
  results = []
  threads = [threading.Thread(target=lambda: results.append(ex.put("m", (5,), {"same": 1})))
             for _ in range(8)]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  assert sorted(results) == [False] * 7 + [True]


_RACER = """
import json, sys, time
from mgrpo_jax import exchange as xc
ex = xc.Exchange(sys.argv[1], run="race")
me, start = int(sys.argv[2]), float(sys.argv[3])
while time.time() < start:
  pass
won = []
for k in range(60):
  try:
    if ex.put("result", (k, 0), {"writer": me}):
      won.append(k)
  except xc.ExchangeConflict as e:
    assert e.existing["writer"] != me
print(json.dumps(won))
"""


def test_processes_race_on_file_exactly_one_wins(tmp_path):
  url = f"file://{tmp_path}"
  start = time.time() + 1.0  # After every interpreter has started.
  procs = [subprocess.Popen([sys.executable, "-c", _RACER, url, str(i), str(start)],
                            stdout=subprocess.PIPE, text=True) for i in range(4)]
  wins = {}
  for i, p in enumerate(procs):
    out, _ = p.communicate(timeout=60)
    assert p.returncode == 0
    for k in json.loads(out):
      assert k not in wins, f"key {k} won by both {wins[k]} and {i}"
      wins[k] = i
  assert sorted(wins) == list(range(60))
  ex = xc.Exchange(url, run="race")
  assert all(ex.get("result", (k, 0)) == {"writer": w} for k, w in wins.items())


def test_corrupt_records_are_reported_by_key(tmp_path):
  ex = xc.Exchange(f"file://{tmp_path}", run="r")
  for k in range(3):
    ex.put("result", (4, k), {"text": f"answer {k}", "r": 0.5})
  path = tmp_path / "r/result/00000004/0001.json"
  raw = path.read_bytes()
  path.write_bytes(raw.replace(b"answer 1", b"answer 7"))  # Valid JSON, wrong checksum.
  with pytest.raises(xc.ExchangeCorrupt, match="r/result/00000004/0001.json.*checksum"):
    ex.get("result", (4, 1))
  with pytest.raises(xc.ExchangeCorrupt, match="00000004/0001.json"):
    ex.get_many("result", [(4, 0), (4, 1), (4, 2)], timeout_s=1)
  with pytest.raises(xc.ExchangeCorrupt, match="00000004/0001.json"):  # Not a conflict.
    ex.put("result", (4, 1), {"text": "answer 1", "r": 0.5})
  path.write_bytes(raw[: len(raw) // 2])  # Truncated.
  with pytest.raises(xc.ExchangeCorrupt, match="not valid JSON"):
    ex.try_get("result", (4, 1))
  other = tmp_path / "r/result/00000004/0002.json"
  other.write_bytes((tmp_path / "r/result/00000004/0000.json").read_bytes())  # Misplaced.
  with pytest.raises(xc.ExchangeCorrupt, match="holds the record of"):
    ex.get("result", (4, 2))
  assert ex.get("result", (4, 0)) == {"text": "answer 0", "r": 0.5}
  assert ex.list("result", (4,)) == [(4, 0), (4, 1), (4, 2)]  # Listed, never skipped.


def test_arrays_round_trip_bitwise(ex):
  rng = np.random.default_rng(0)
  r_QxK = rng.normal(size=(3, 5)).astype(np.float32)
  r_QxK[0, 0], r_QxK[1, 2], r_QxK[2, 4] = np.nan, -0.0, np.inf
  assert ex.put_array("r_main", 7, r_QxK)
  got = ex.get_array("r_main", 7, timeout_s=1)
  assert got.dtype == np.float32 and got.shape == (3, 5)
  np.testing.assert_array_equal(got.view(np.uint32), r_QxK.view(np.uint32))
  assert ex.put_array("r_main", 7, r_QxK.copy()) is False
  with pytest.raises(xc.ExchangeConflict, match="r1/_array/r_main/00000007.json"):
    ex.put_array("r_main", 7, r_QxK + 1)
  with pytest.raises(xc.ExchangeConflict):  # Same bytes, other dtype.
    ex.put_array("r_main", 7, r_QxK.view(np.int32))
  for name, a in [("valid", np.array([[True, False]])), ("lens", np.arange(7, dtype=np.int32)),
                  ("zeros", np.zeros((2, 3), np.float32)), ("empty", np.zeros((0, 3)))]:
    ex.put_array(name, 0, a)
    got = ex.get_array(name, 0)
    assert got.dtype == a.dtype and np.array_equal(got, a)


def test_array_reader_blocks_until_commit(ex):
  a = np.arange(15, dtype=np.float32).reshape(3, 5)
  got = {}
  reader = threading.Thread(target=lambda: got.update(a=ex.get_array("r", 1, timeout_s=10)))
  reader.start()
  time.sleep(0.2)
  assert reader.is_alive()
  ex.put_array("r", 1, a)
  reader.join(5)
  np.testing.assert_array_equal(got["a"], a)


def test_array_without_commit_is_invisible(ex, monkeypatch):
  """A writer dying between the data and the commit leaves nothing a reader can see."""
  a = np.ones((3, 5), np.float32)

  def die(*args):
    raise KeyboardInterrupt("killed")

  with monkeypatch.context() as m:
    m.setattr(ex, "_put", die)
    with pytest.raises(KeyboardInterrupt):
      ex.put_array("r", 2, a)
  with pytest.raises(xc.ExchangeTimeout, match="r1/_array/r/00000002.json"):
    ex.get_array("r", 2, timeout_s=0.1)
  assert ex.put_array("r", 2, a)  # The restarted writer publishes it.
  np.testing.assert_array_equal(ex.get_array("r", 2), a)


def test_corrupt_array_data_is_reported(tmp_path):
  ex = xc.Exchange(f"file://{tmp_path}", run="r")
  ex.put_array("r", 3, np.arange(6, dtype=np.float32).reshape(2, 3))
  (chunk,) = (tmp_path / "r/_array_data/r/00000003").glob("*/0.0")
  raw = bytearray(chunk.read_bytes())
  raw[-1] ^= 1
  chunk.write_bytes(bytes(raw))
  with pytest.raises(xc.ExchangeCorrupt, match="r/_array/r/00000003.json.*checksum"):
    ex.get_array("r", 3)


def test_marks(ex):
  assert ex.marks("rollouts") == []
  assert ex.mark("rollouts", 0, {"episodes": 12})
  assert ex.mark("rollouts", 0, {"episodes": 12}) is False
  ex.mark("rollouts", 1)
  assert ex.wait_mark("rollouts", 0, timeout_s=1) == {"episodes": 12}
  assert ex.marks("rollouts") == [0, 1]
  with pytest.raises(xc.ExchangeTimeout, match="r1/_mark/rollouts/00000002.json"):
    ex.wait_mark("rollouts", 2, timeout_s=0.05)
  ex.put("rollouts", (5,), {})  # Records of the same kind name do not count as marks.
  assert ex.marks("rollouts") == [0, 1]


def test_stats_count_bytes(ex):
  rec = {"text": "x" * 100}
  ex.put("result", (0, 0, 0, 0), rec)
  ex.get("result", (0, 0, 0, 0))
  ex.put_array("r", 0, np.zeros((3, 5), np.float32))
  s = ex.stats(reset=True)
  record = s["by_kind"]["result"]
  assert record["records_written"] == record["records_read"] == 1
  assert record["bytes_written"] == record["bytes_read"] > 100
  assert s["by_kind"]["_array/r"]["bytes_written"] > 60  # 60 data bytes + the commit.
  assert s["bytes_written"] == record["bytes_written"] + s["by_kind"]["_array/r"]["bytes_written"]
  assert ex.stats()["bytes_written"] == 0


def test_specs_of_places_inside_a_run_location(tmp_path):
  """One URL, JSON spec or path locates a run; its parts are directories below it."""
  assert xc.kvstore_spec(f"file://{tmp_path}/r1", "main/checkpoints") == {
      "driver": "file", "path": f"{tmp_path}/r1/main/checkpoints/"}
  assert xc.kvstore_spec(str(tmp_path / "r1"), "/sub/") == {
      "driver": "file", "path": f"{tmp_path}/r1/sub/"}
  spec = xc.kvstore_spec('{"driver": "s3", "bucket": "b-1", "path": "runs/r1", '
                         '"endpoint": "http://127.0.0.1:9"}', "exchange")
  assert spec["path"] == "runs/r1/exchange/" and spec["endpoint"] == "http://127.0.0.1:9"
  assert spec["use_conditional_write"] is True
  assert xc.kvstore_spec("memory://", "x") == {"driver": "memory", "path": "x/"}
  # The exchange of a run lives in its own namespace, beside the checkpoints.
  ex = xc.Exchange(f"file://{tmp_path}/r1", run="exchange")
  ex.put("request", (0, 1), {"a": 1})
  assert (tmp_path / "r1" / "exchange" / "request" / "00000000" / "0001.json").exists()


def test_memory_store_is_shared_within_a_process():
  path = f"shared-{uuid.uuid4().hex}"
  a = xc.Exchange({"driver": "memory", "path": path})
  b = xc.Exchange(json.dumps({"driver": "memory", "path": path}))  # A JSON string spec.
  a.put("request", (0, 0, 0, 0), {"t": 1})
  a.put_array("r", 0, np.ones(3, np.float32))
  assert b.get("request", (0, 0, 0, 0)) == {"t": 1}
  np.testing.assert_array_equal(b.get_array("r", 0), np.ones(3, np.float32))


_WRITER = """
import sys
import numpy as np
from mgrpo_jax import exchange as xc
ex = xc.Exchange(sys.argv[1], run="crash")
done = new = 0

def progress(is_new):
  # One line per finished operation, so the test can kill at a chosen point.
  global done, new
  done, new = done + 1, new + is_new
  print("done", done, flush=True)

for step in range(4):
  for q in range(4):
    for k in range(4):
      for call in range(2):
        # Deterministic content, as a restarted program with the same seed produces.
        rec = {"text": f"result {step}/{q}/{k}/{call} " + "y" * 200, "version": step}
        progress(ex.put("result", (step, q, k, call), rec))
  progress(ex.put_array("r_main", step, np.full((4, 4), step, np.float32) + np.arange(4)))
  progress(ex.mark("done", step))
print("new", new, flush=True)
"""
_TOTAL = 4 * (4 * 4 * 2 + 2)  # Records, one array and one mark per step.


def _writer(url):
  return subprocess.Popen([sys.executable, "-c", _WRITER, url], stdout=subprocess.PIPE,
                          text=True)


def _new_count(proc):
  out, _ = proc.communicate(timeout=60)
  assert proc.returncode == 0, out[-2000:]
  return int(out.split()[-1])


def test_sigkill_mid_puts_leaves_complete_records_and_rerun_is_idempotent(tmp_path):
  rng = random.Random(0)
  for trial in range(3):
    url = f"file://{tmp_path}/t{trial}"
    proc = _writer(url)
    kill_after = rng.randrange(1, _TOTAL - 20)
    while proc.stdout.readline().split() != ["done", str(kill_after)]:
      pass
    time.sleep(rng.uniform(0.0, 0.004))  # Land inside a later write, not between two.
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    ex = xc.Exchange(url, run="crash")
    present = ex.list("result")
    for key in present:  # Every record there is whole: no ExchangeCorrupt.
      assert ex.get("result", key)["version"] == key[0]
    committed = ex.array_steps("r_main")
    for s in committed:
      np.testing.assert_array_equal(ex.get_array("r_main", s)[:, 1], s + 1)
    before = len(present) + len(committed) + len(ex.marks("done"))
    assert kill_after <= before < _TOTAL
    new = _new_count(_writer(url))  # Rerun: completes the set, no conflict raised.
    assert before + new == _TOTAL
    assert len(ex.list("result")) == 4 * 4 * 4 * 2 and ex.marks("done") == [0, 1, 2, 3]
    if trial == 0:
      assert _new_count(_writer(url)) == 0  # A third run writes nothing.


@pytest.mark.parametrize("backend", ["s3", "gcs"])
def test_object_store_round_trip_and_exactly_once(backend, request, monkeypatch):
  if backend == "gcs":  # fake-gcs-server; tensorstore's gcs driver pointed at it.
    request.getfixturevalue("gcs_endpoint")
    ex = xc.Exchange(f"gs://exchange/runs/{uuid.uuid4().hex}", run="r1")
    assert ex.spec["driver"] == "gcs"
  else:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    spec = {"driver": "s3", "bucket": "exchange", "path": f"runs/{uuid.uuid4().hex}",
            "endpoint": request.getfixturevalue("s3_endpoint"), "aws_region": "us-east-1"}
    ex = xc.Exchange(json.dumps(spec), run="r1")
    assert ex.spec["use_conditional_write"] is True
  assert ex.put("result", (0, 1, 2, 0), {"text": "ok", "version": 3})
  assert ex.put("result", (0, 1, 2, 0), {"text": "ok", "version": 3}) is False
  with pytest.raises(xc.ExchangeConflict, match="r1/result/00000000/0001/0002/0000.json"):
    ex.put("result", (0, 1, 2, 0), {"text": "other", "version": 3})
  assert ex.get("result", (0, 1, 2, 0)) == {"text": "ok", "version": 3}
  assert ex.list("result", (0,)) == [(0, 1, 2, 0)]
  with pytest.raises(xc.ExchangeTimeout, match="00000000/0001/0002/0001.json"):
    ex.get("result", (0, 1, 2, 1), timeout_s=0.1)
  a = np.random.default_rng(1).normal(size=(3, 5)).astype(np.float32)
  assert ex.put_array("r_main", 0, a)
  np.testing.assert_array_equal(ex.get_array("r_main", 0).view(np.uint32), a.view(np.uint32))
  ex.mark("rollouts", 0)
  assert ex.marks("rollouts") == [0]
  # Racing writers of different content: the server's If-None-Match picks one.
  outcomes = []
  barrier = threading.Barrier(8)

  def racer(t):
    barrier.wait()
    try:
      outcomes.append(ex.put("result", (1,), {"writer": t}))
    except xc.ExchangeConflict:
      outcomes.append("conflict")

  threads = [threading.Thread(target=racer, args=(t,)) for t in range(8)]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  assert sorted(map(str, outcomes)) == ["True"] + ["conflict"] * 7
