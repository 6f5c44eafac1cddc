"""Test setup: 8 fake CPU devices, set before anything imports JAX; shared fixtures."""

import atexit
import os
import shutil
import socket
import subprocess
import tempfile
import time

import pytest  # Imports no JAX, so the flags below still come first.

# Must run before `import jax` anywhere, so sharding is testable on a CPU-only machine. An
# explicit count in XLA_FLAGS wins (=1 shows which tests a one-device machine skips).
if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (
      os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
# CPU unless told otherwise: `JAX_PLATFORMS=cuda python -m pytest` runs the suite on a GPU.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Every numeric test compares float32 results with a float32 reference (transformers, NumPy,
# the padded batch); on GPU XLA's default f32 matmul is TF32 (relative error ~3e-3), so the
# suite pins full precision. bf16/fp16 kernels (cuDNN attention) are unaffected.
os.environ.setdefault("JAX_DEFAULT_MATMUL_PRECISION", "highest")
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
  """Skips `gpu` tests off GPU, and `devices(n)` tests where fewer than n devices exist."""
  del config
  import jax  # Only now: XLA_FLAGS above are set first.
  on_gpu, count = jax.default_backend() == "gpu", jax.device_count()
  for item in items:
    if "gpu" in item.keywords and not on_gpu:
      item.add_marker(pytest.mark.skip(reason="needs a GPU (JAX backend is not 'gpu')"))
    need = item.get_closest_marker("devices")
    if need is not None and need.args[0] > count:
      item.add_marker(pytest.mark.skip(reason=f"needs {need.args[0]} devices, {count} here"))


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
