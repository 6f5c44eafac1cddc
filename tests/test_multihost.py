"""Multi-host: launch/train.py as two `jax.distributed` processes on localhost (4 CPUs each).

The pair trains colocated M-GRPO (`configs/mgrpo.py:smoke` with a tiny MoE whose experts
are split over 2 devices) on one 8-device mesh that spans
both processes, is restarted from its checkpoint to train one step further, and must write
the metrics and final weights of one process with 8 devices (this test's own, see
conftest.py). Cross-process CPU collectives run over gloo.
"""

import os
import shutil
import socket
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file

from configs import mgrpo
from configs import sft as sft_config
from mgrpo_jax import distributed, metrics
from mgrpo_jax.mgrpo import colocated, sft

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# A tiny mixture of experts with its experts split over 2 devices (mesh: 4 data x 2 expert),
# so the pair also runs the MoE dispatch across the process boundary.
CONFIG = "configs/mgrpo.py:smoke,model=tiny_moe"
EXPERT = "--config.mesh.expert=2"
# One aligned sub-agent episode per main rollout (D = 1): the sub batch then has the main
# batch's shape (Q*K rows of 128 tokens), so the pair and the one-process run each compile
# one train step for both agents instead of two (about a third of a launch's compile time).
ALIGN = "--config.align_d=1"
TIMEOUT_S = 400
# A group (.ci/run's --dist loadgroup): groups of several tests are handed out first, so the
# two longest tests of the suite (about 2 and 4 minutes on 2 cores) start at its beginning
# instead of leaving one pytest-xdist worker running alone at its end.
pytestmark = pytest.mark.xdist_group("multihost")


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _env(cache_dir) -> dict:
  e = dict(os.environ)
  flags = [f for f in e.get("XLA_FLAGS", "").split()
           if not f.startswith("--xla_force_host_platform_device_count")]
  e["XLA_FLAGS"] = " ".join(flags + ["--xla_force_host_platform_device_count=4"])
  # The two launches of the pair share compiled programs (same topology, same numbers).
  e.update(JAX_PLATFORMS="cpu", JAX_COMPILATION_CACHE_DIR=str(cache_dir),
           JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
           PYTHONPATH=os.pathsep.join([ROOT, e.get("PYTHONPATH", "")]))
  for var in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID",
              "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE"):
    e.pop(var, None)
  return e


def _train_pair(workdir, env, *extra, config=CONFIG) -> None:
  """launch/train.py as processes 0 and 1 of one run; fails with their logs."""
  port, procs, logs = _free_port(), [], []
  try:
    for i in range(2):
      logs.append(os.path.join(workdir, f"process{i}.log"))
      with open(logs[-1], "w") as f:
        procs.append(subprocess.Popen(
            [sys.executable, "launch/train.py", f"--config={config}", f"--workdir={workdir}",
             f"--coordinator_address=127.0.0.1:{port}", "--num_processes=2",
             f"--process_id={i}", *extra], cwd=ROOT, env=env, stdout=f,
            stderr=subprocess.STDOUT))
    deadline = time.monotonic() + TIMEOUT_S
    for i, proc in enumerate(procs):
      try:
        rc = proc.wait(max(1.0, deadline - time.monotonic()))
      except subprocess.TimeoutExpired:
        rc = "a timeout"
      if rc != 0:
        tails = "\n".join(f"--- process {j}:\n{open(log).read()[-3000:]}"
                          for j, log in enumerate(logs))
        pytest.fail(f"process {i} ended with {rc}:\n{tails}")
  finally:
    for proc in procs:
      if proc.poll() is None:
        proc.kill()
        proc.wait()


def _rows(workdir):
  return metrics.stable(metrics.read_metrics(str(workdir)))


def _assert_same_rows(got, want):
  assert [r["step"] for r in got] == [r["step"] for r in want]
  for g, w in zip(got, want):
    assert sorted(g) == sorted(w), g["step"]
    for k, v in w.items():
      # Sums over devices are reduced in another order across the process boundary (gloo):
      # float32 metrics agree to rounding; counts, rewards and sampled tokens exactly.
      if isinstance(v, float):
        np.testing.assert_allclose(g[k], v, rtol=1e-5, atol=1e-6, err_msg=f"{k} at {w['step']}")
      else:
        assert g[k] == v, (k, w["step"])


@pytest.mark.slow
@pytest.mark.devices(8)
def test_two_processes_train_save_restore_like_one(tmp_path):
  ref = tmp_path / "one_process"
  c = mgrpo.get_config("smoke,model=tiny_moe")
  c.mesh.expert, c.align_d = 2, 1
  colocated.train_and_evaluate(c, str(ref))  # 8 devices, here.
  env = _env(tmp_path / "xla_cache")
  pair = tmp_path / "two_processes"
  os.makedirs(pair)
  # Step 0, checkpoint 1, eval 1.
  _train_pair(str(pair), env, EXPERT, ALIGN, "--config.num_steps=1")
  assert [r["step"] for r in _rows(pair)] == [0, 1]
  # A crash between orbax's commit of step 2 and its digests left this: every process must
  # agree to drop it (process 0 deletes it) before saving step 2 again.
  shutil.copytree(pair / "checkpoints" / "1", pair / "checkpoints" / "2")
  os.remove(pair / "checkpoints" / "2" / "_DIGESTS")
  _train_pair(str(pair), env, EXPERT, ALIGN)  # Restores step 1, trains it, evaluates step 2.
  assert "Deleting uncommitted checkpoint directory" in open(pair / "process0.log").read()
  assert "Restored" in open(pair / "process1.log").read()
  _assert_same_rows(_rows(pair), _rows(ref))
  assert sorted(os.listdir(pair / "checkpoints")) == ["1", "2"]
  for agent in ("main", "sub"):  # Gathered from both processes' shards, written by one.
    got = load_file(str(pair / "hf" / agent / "model.safetensors"))
    want = load_file(str(ref / "hf" / agent / "model.safetensors"))
    assert sorted(got) == sorted(want)
    for name in want:
      np.testing.assert_array_equal(got[name], want[name], err_msg=name)


@pytest.mark.slow
@pytest.mark.devices(8)
def test_two_processes_reduce_gradients_like_one(tmp_path):
  # M-GRPO's random smoke models earn no reward, so their updates are zero: the SFT warm
  # start (same program loop and train step, NLL gradients) shows the cross-process
  # gradient reduction and optimizer update.
  # Adam's update lr * m / (sqrt(v) + eps) turns a gradient's rounding into a whole update
  # where the gradient nearly cancels (|g| ~ eps): with eps 1e-8, summed in another order on
  # an AVX2 machine, one weight of 11264 moved by 2.3e-6. With eps 1e-3 the update stays
  # about linear in such gradients, so the weights differ by what the sums' rounding does,
  # while a reduction that missed a process's rows would move them by about lr (1e-3).
  c = sft_config.get_config("smoke")
  c.sft.batch_size = 8  # Rows split over 8 devices.
  c.main_optim.eps = c.sub_optim.eps = 1e-3
  ref = tmp_path / "one_process"
  sft.train_sft(c, str(ref))
  pair = tmp_path / "two_processes"
  os.makedirs(pair)
  _train_pair(str(pair), _env(tmp_path / "xla_cache"), "--config.sft.batch_size=8",
              "--config.main_optim.eps=0.001", "--config.sub_optim.eps=0.001",
              config="configs/sft.py:smoke")
  rows = _rows(pair)
  assert rows[0]["sft/main/grad_norm"] > 0.1 and rows[1]["sft/sub/nll"] < rows[0]["sft/sub/nll"]
  _assert_same_rows(rows, _rows(ref))
  for agent in ("main", "sub"):  # Gradients summed in another order: equal to rounding.
    got = load_file(str(pair / "hf" / agent / "model.safetensors"))
    want = load_file(str(ref / "hf" / agent / "model.safetensors"))
    for name in want:
      np.testing.assert_allclose(got[name], want[name], atol=1e-6, err_msg=name)


def test_one_process_needs_no_distributed_runtime(monkeypatch):
  for var in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID",
              "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE"):
    monkeypatch.delenv(var, raising=False)
  monkeypatch.setenv("SLURM_NTASKS", "1")  # A one-task SLURM job is one process too.
  assert distributed.initialize() is False
  assert distributed.is_primary()
  texts = ["a", "é\n{}"]
  assert distributed.broadcast_object(texts) == texts
  mesh = jax.sharding.Mesh(np.asarray(jax.devices()), ("d",))
  x = np.arange(2.0 * len(jax.devices()))
  sharded = jax.device_put(x, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("d")))
  np.testing.assert_array_equal(distributed.fetch(sharded), x)
