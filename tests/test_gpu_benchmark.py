"""benchmarks/gpu.py: its FLOP and byte counts, and every code path at tiny shapes on CPU."""

import json
import os
import subprocess
import sys

import jax
import pytest

from mgrpo_jax import kv_cache_plan, models

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _norms(cfg):
  return cfg.num_layers * 2 * (cfg.hidden_size + cfg.head_dim) + cfg.hidden_size


@pytest.mark.parametrize("tie", [True, False])
def test_matmul_weights_are_every_weight_but_norms_and_lookup(load_benchmark, tie):
  gpu = load_benchmark("gpu")
  cfg = models.get_preset("qwen3_0p6b", tie_embeddings=tie)
  lookup = 0 if tie else cfg.vocab_size * cfg.hidden_size  # Tied: the table is the head.
  assert gpu.matmul_params(cfg) == cfg.num_params() - _norms(cfg) - lookup


def test_flops_and_bytes_by_hand(load_benchmark):
  gpu = load_benchmark("gpu")
  cfg = models.get_preset("tiny")  # 2 layers, 4 heads of 16, D 64, F 176, V 384, tied.
  matmul = 2 * (64 * 64 * 2 + 64 * 32 * 2 + 3 * 64 * 176) + 64 * 384
  assert gpu.matmul_params(cfg) == matmul == 116_736
  # One token attending to 10 keys: q.k and p.v, 2 FLOPs per multiply-add, 2 layers x 64.
  assert gpu.forward_flops_per_token(cfg, 10) == 2 * matmul + 2 * 2 * 2 * 64 * 10
  # A sequence of 4 tokens sees 1..4 keys: 2.5 on average; training is 3 forwards.
  assert gpu.train_flops(cfg, 8, 4) == 3 * 8 * gpu.forward_flops_per_token(cfg, 2.5)
  bf16 = models.get_preset("qwen3_0p6b", compute_dtype="bfloat16")
  kv = gpu.decode_bytes_per_step(bf16, 64, 1024) - 2 * bf16.num_params()
  assert kv == kv_cache_plan.kv_cache_bytes(bf16, 64, 1024)  # The sampler's own count.
  assert gpu.device_specs("NVIDIA H100 80GB HBM3") == {"hbm_bytes_per_s": 3.35e12,
                                                       "bf16_flops_per_s": 989e12}
  assert gpu.device_specs("cpu") is None


def _run(*args, tmp_path):
  env = dict(os.environ, PYTHONPATH=ROOT)
  return subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "gpu.py"), *args],
                        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="the no-GPU message")
def test_without_a_gpu_it_says_so_and_exits_0(tmp_path):
  out = _run(tmp_path=tmp_path)
  assert out.returncode == 0, out.stderr
  assert "backend is 'cpu'" in out.stdout and not list(tmp_path.iterdir())


def test_tiny_run_measures_every_kind_of_case(tmp_path):
  path = tmp_path / "gpu.json"
  out = _run("--tiny", f"--out={path}", "--batches=2", "--variant_batches=2",
             tmp_path=tmp_path)
  assert out.returncode == 0, out.stderr[-3000:]
  result = json.loads(path.read_text())
  cases = result["cases"]
  assert sorted(cases) == sorted(["decode/tiny/b2", "decode/tiny/b2/no_options",
                                  "decode/tiny/b2/splits3", "prefill/tiny/b2",
                                  "update/tiny/256/nothing", "update/tiny/256/save_dots"])
  assert not [n for n, c in cases.items() if "error" in c or "skipped" in c], cases
  decode = cases["decode/tiny/b2"]
  assert decode["ms_per_step"] > 0 and decode["generate_s"] > decode["prefill_s"]
  assert cases["decode/tiny/b2/splits3"]["decode_splits"] == 3
  update = cases["update/tiny/256/save_dots"]
  assert update["rows"] == 4 and update["tokens_per_s"] > 0 and update["compiled_gb"] > 0
  assert result["tiny"] and result["device"] == jax.devices()[0].device_kind
