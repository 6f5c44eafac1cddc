"""benchmarks/memory.py and its case builders (benchmarks/step_cases.py) at mid and tiny
shapes: update memory grows linearly with sequence length; the MoE and LoRA cases compile."""

import os
import subprocess
import sys

import pytest

from mgrpo_jax.compiled import step_cases


@pytest.mark.slow
def test_update_temporaries_grow_linearly_with_length():
  # The plain padded make_train_step of Qwen3-0.6B (real vocabulary and widths), compiled
  # with abstract inputs: with [T, T] scores or [B, T, V] logits each doubling of T would
  # cost ~4x / 2x of a large term (at 2819582: 14.0 -> 25.0 -> 62.5 GB at 2k/4k/8k).
  cases = [step_cases.scaling_case("qwen3_0p6b", t, rows=2) for t in (2048, 4096, 8192)]
  temps = [c["temporaries_gb"] for c in cases]
  assert all(b / a < 2.2 for a, b in zip(temps, temps[1:])), temps
  assert temps[-1] < 20, temps  # 0.6B, 2 x 8192 tokens, remat: ~11 GB measured.
  assert cases[0]["arguments_gb"] > 7  # f32 params + Adam moments of 0.6B: really 0.6B.


@pytest.mark.slow
@pytest.mark.devices(8)
def test_moe_cases_compile_on_an_expert_mesh():
  # The 64-device Qwen3-30B-A3B cases' code path at tiny size on 2 fsdp x 4 expert: the
  # update and decode steps compile with abstract sharded inputs, and the expert weights
  # really are split (arguments per device well below the unsharded state).
  axes = dict(data=1, fsdp=2, tensor=1, expert=4)
  update = step_cases.update_case("tiny_moe", 8, 64, mesh_axes=axes, moe_chunk=16)
  assert update["mesh"] == {"fsdp": 2, "expert": 4} and update["rows_per_micro"] == 8
  # Unsharded, the f32 params and two Adam moments alone take 12 bytes per parameter.
  assert update["arguments_gb"] * 1e9 < 0.5 * 12 * update["params"]
  decode = step_cases.decode_case("tiny_moe", rows=8, reached=64, max_len=128, mesh_axes=axes)
  assert decode["total_gb"] > 0 and decode["mesh"] == {"fsdp": 2, "expert": 4}


def test_lora_update_holds_the_base_once_and_state_for_adapters_only():
  # Qwen3-0.6B, rank 16 on every projection: ~10M adapter parameters (f32, two Adam moments),
  # beside a 2.4 GB f32 base that is an argument of the step and never comes back out.
  case = step_cases.update_case("qwen3_0p6b", 16, 2048, lora_rank=16)
  assert 9e6 < case["adapter_params"] < 12e6
  assert abs(case["base_gb"] - 4 * case["params"] / 1e9) < 1e-6
  assert case["state_gb"] < 0.15
  assert case["arguments_gb"] < case["base_gb"] + case["state_gb"] + 0.05  # batch: ~1 MB
  assert case["outputs_gb"] < case["state_gb"] + 0.01  # No base or gradient copy out.


def test_memory_script_lists_its_cases():
  # The script over the library: it imports (the package and benchmarks/step_cases.py) and
  # names every case, the paper's 64-device MoE and the LoRA agents among them.
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env = dict(os.environ, PYTHONPATH=root)
  r = subprocess.run([sys.executable, os.path.join(root, "benchmarks", "memory.py"), "--list"],
                     cwd=root, env=env, capture_output=True, text=True, timeout=300)
  assert r.returncode == 0, r.stderr[-3000:]
  cases = r.stdout.split()
  assert {"update/qwen3_30b_a3b/main", "decode/qwen3_30b_a3b/reached=1024",
          "update/qwen3_1p7b/sub+lora16+bf16base", "scaling/T=32768"} <= set(cases), cases
  assert len(cases) == 21, cases
