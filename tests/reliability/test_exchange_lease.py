"""One writer per role: a second program of a role on one exchange is refused, by name."""

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import uuid

import pytest

from mgrpo_jax import exchange
from mgrpo_jax import lease as lease_lib

_HOLDER = textwrap.dedent("""
    import sys, time
    from mgrpo_jax import lease as lease_lib
    lease = lease_lib.acquire_lease(sys.argv[1], "sub", run="exchange",
                                    timeout_s=float(sys.argv[2]))
    print("holding", flush=True)
    time.sleep(600)
""")


def _start(location, timeout_s=60.0):
  env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
  return subprocess.Popen([sys.executable, "-c", _HOLDER, str(location), str(timeout_s)],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def test_second_program_of_a_role_exits_naming_the_first(tmp_path):
  first = _start(tmp_path)
  try:
    assert first.stdout.readline() == "holding\n", first.stderr.read()
    t0 = time.monotonic()
    second = _start(tmp_path)
    _, err = second.communicate(timeout=30)
    assert second.returncode != 0 and time.monotonic() - t0 < 10
    assert "LeaseHeld" in err and f"pid {first.pid}" in err, err
    # Killed (no release): this machine sees its pid is gone and takes over at once.
    first.send_signal(signal.SIGKILL)
    first.wait()
    with lease_lib.acquire_lease(tmp_path, "sub", run="exchange") as lease:
      assert lease.record["pid"] == os.getpid()
  finally:
    first.kill()


def test_memory_exchange_lease_and_release():
  url = f"memory://{uuid.uuid4().hex}/"
  with lease_lib.acquire_lease(url, "main"):
    with pytest.raises(lease_lib.LeaseHeld, match=f"pid {os.getpid()}"):
      lease_lib.acquire_lease(url, "main")
    lease_lib.acquire_lease(url, "sub").release()  # Roles are independent.
  lease_lib.acquire_lease(url, "main").release()  # Released: free again.


def _object_store(backend, request, monkeypatch, name):
  """A fresh location on a local S3 (moto) or GCS (fake-gcs-server)."""
  if backend == "gcs":
    request.getfixturevalue("gcs_endpoint")  # Points tensorstore's gcs driver at it.
    return f"gs://exchange/{name}-{uuid.uuid4().hex}"
  monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
  monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
  return {"driver": "s3", "bucket": "exchange", "path": f"{name}-{uuid.uuid4().hex}",
          "endpoint": request.getfixturevalue("s3_endpoint"), "aws_region": "us-east-1"}


@pytest.mark.parametrize("backend", ["s3", "gcs"])
def test_stale_lease_is_taken_over_and_the_old_holder_cannot_write(backend, request,
                                                                   monkeypatch):
  spec = _object_store(backend, request, monkeypatch, "lease")
  lost = threading.Event()
  old = lease_lib.acquire_lease(spec, "sub", timeout_s=0.5, on_lost=lambda e: lost.set())
  with pytest.raises(lease_lib.LeaseHeld):
    lease_lib.acquire_lease(spec, "sub")
  old._stop.set()  # A holder that hangs: no more renewals, never released.
  old._thread.join()
  time.sleep(0.6)
  new = lease_lib.acquire_lease(spec, "sub", timeout_s=30)
  # The old holder wakes up: its conditional renewal fails, and it learns it lost.
  old._stop.clear()
  old._thread = threading.Thread(target=old._renew_loop, daemon=True)
  old._thread.start()
  assert lost.wait(5)
  with pytest.raises(lease_lib.LeaseLost):
    old.check()
  old.release()  # Must not clobber the new holder's lease.
  with pytest.raises(lease_lib.LeaseHeld, match=f"pid {os.getpid()}"):
    lease_lib.acquire_lease(spec, "sub")
  new.release()


@pytest.mark.parametrize("backend", ["file", "s3", "gcs"])
def test_racing_takeovers_of_a_stale_lease_have_one_winner(backend, tmp_path, request,
                                                           monkeypatch):
  if backend == "file":
    location = str(tmp_path)
  else:
    location = _object_store(backend, request, monkeypatch, "race")
  stale = lease_lib.acquire_lease(location, "main", timeout_s=0.2)
  stale._stop.set()
  stale._thread.join()
  time.sleep(0.3)
  barrier, won, refused = threading.Barrier(8), [], []

  def contender():
    ex = exchange.Exchange(location, run="run")
    barrier.wait()
    try:
      won.append(lease_lib.acquire_lease(ex, "main", timeout_s=30))
    except lease_lib.LeaseHeld:
      refused.append(1)
  threads = [threading.Thread(target=contender) for _ in range(8)]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  assert (len(won), len(refused)) == (1, 7)
  won[0].release()
