"""Test setup: 8 fake CPU devices, set before anything imports JAX; shared fixtures."""

import atexit
import os
import shutil
import socket
import subprocess
import tempfile
import time

import pytest  # Imports no JAX, so the flags below still come first.

# Must run before `import jax` anywhere, so sharding is testable on a CPU-only machine.
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# A compilation cache per test worker, never reused across sessions (CI starts clean): tests
# that build the same tiny programs again (resume tests, end-to-end runs, the programs they
# start as subprocesses) load them instead of recompiling, about half the CPU time of those
# tests (measured on tests/magrpo/test_train.py). A max size turns on JAX's file lock, so
# concurrent processes never read a half-written entry.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="mgrpo_jax_xla_cache_")
  atexit.register(shutil.rmtree, os.environ["JAX_COMPILATION_CACHE_DIR"], True)
  os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0.2"
  os.environ["JAX_COMPILATION_CACHE_MAX_SIZE"] = str(4 << 30)


def pytest_collection_modifyitems(config, items):
  """Skips `@pytest.mark.gpu` tests unless JAX runs on a GPU."""
  del config
  import jax  # Only now: XLA_FLAGS above are set first.
  if jax.default_backend() == "gpu":
    return
  skip = pytest.mark.skip(reason="needs a GPU (JAX backend is not 'gpu')")
  for item in items:
    if "gpu" in item.keywords:
      item.add_marker(skip)


def _free_port():
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


@pytest.fixture(scope="session")
def s3_endpoint():
  """A local S3 (moto's server) with one bucket; skipped when moto is not installed."""
  pytest.importorskip("moto")
  boto3 = pytest.importorskip("boto3")
  server = shutil.which("moto_server")
  if server is None:
    pytest.skip("moto_server is not installed (pip install 'moto[server]')")
  port = _free_port()
  proc = subprocess.Popen([server, "-H", "127.0.0.1", "-p", str(port)],
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  endpoint = f"http://127.0.0.1:{port}"
  try:
    deadline = time.monotonic() + 20
    while True:
      try:
        socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
        break
      except OSError:
        assert time.monotonic() < deadline and proc.poll() is None, "moto_server did not start"
        time.sleep(0.05)
    boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1",
                 aws_access_key_id="testing",
                 aws_secret_access_key="testing").create_bucket(Bucket="exchange")
    yield endpoint
  finally:
    proc.terminate()
    proc.wait(10)
