"""CI sees the GPU program: a small model's decode loop and update, compiled for an H100 on
this CPU (the CUDA plugin and compiler wheels of the `gpu` extra; no GPU, no driver), checked
structurally with benchmarks/hlo_stats.py (definitions: docs/results/gpu-compile.md).

Each check fails on the program it guards against (the fixes that made them pass:
the decode loop reads per-layer weights and caches in place, the log-prob chunks gather nothing,
the packed update runs cuDNN's fused attention); a toy loop shows the copy check catching one.
Without the CUDA wheels the compiles fail with the install command: no silent skip.
"""

import functools
import math
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
from jax.experimental.compilation_cache import compilation_cache
from jax._src.cudnn import fused_attention_stablehlo
import pytest

from mgrpo_jax.compiled import gpu, hlo_stats, step_cases
from mgrpo_jax import models, sampling
from mgrpo_jax.models import attention, qwen3

# The small model: Qwen3's proportions where they matter here (a layer's weights far larger
# than a decode step's activations and logits).
# The decode checks: Qwen3-0.6B's widths, vocabulary and head size (what sets the ratio of
# bytes written to bytes read) with 2 of its 28 layers, so it compiles in seconds.
PRESET, LAYERS, ROWS, REACHED, MAX_LEN = "qwen3_0p6b", dict(num_layers=2), 4, 256, 512
# The attention kernel the packed update asks for on GPU: "cudnn" takes the fused kernel
# where it applies (today not on packed rows).
FUSED_ATTENTION = "cudnn_packed"  # cuDNN fused attention over packed rows.
# One worker runs this file under `pytest -n 2 --dist loadgroup` (.ci/run): the fixtures'
# compiles happen once.
pytestmark = pytest.mark.xdist_group("gpu_compile")


@pytest.fixture(scope="module", autouse=True)
def no_persistent_cache():
  """Compiles without the suite's persistent cache (conftest.py): a deviceless compile looks
  up entries it cannot load without a GPU client (jax warns), e.g. a CPU test's program of
  the same name. jax decides once per process whether the cache is used: reset it around."""
  before = jax.config.jax_enable_compilation_cache
  jax.config.update("jax_enable_compilation_cache", False)
  compilation_cache.reset_cache()
  yield
  jax.config.update("jax_enable_compilation_cache", before)
  compilation_cache.reset_cache()


def _devices(count: int, target: str = "h100_sxm"):
  try:
    return gpu.devices(target, count)
  except Exception as e:  # pylint: disable=broad-except
    pytest.fail(f"Cannot compile for a GPU target ({e!r}): this test needs the CUDA plugin "
                f"and compiler wheels, `pip install -e \".[test,gpu]\"` (.ci/run does).")


def _rollout_weights(cfg, params):
  """The weights the sampler's decode loop reads on the `gpu` config's rollout path: the
  per-layer compute-dtype copies `sampling.decode_params` makes once per policy version
  (abstract shapes), whatever the master weights' dtype."""
  return jax.eval_shape(functools.partial(sampling.decode_params, cfg), params)


@pytest.fixture(scope="module")
def decode_loops():
  """{param dtype: (stats, the model config)} of the sampler's decode loop compiled for an
  H100: bf16 weights, and the f32 master weights of the `gpu` config's rollouts."""
  devices = _devices(1)
  out = {}
  for dtype in ("bfloat16", "float32"):
    cfg = models.get_preset(PRESET, param_dtype=dtype, compute_dtype="bfloat16", **LAYERS)
    case, compiled = step_cases.decode_case(PRESET, ROWS, REACHED, MAX_LEN, param_dtype=dtype,
                                            model_overrides=LAYERS,
                                            device_list=devices, return_compiled=True)
    stats = hlo_stats.decode_step_stats(
        compiled.as_text(), cfg, ROWS, case["cache_len"],
        weights=_rollout_weights(cfg, qwen3.abstract_params(cfg)))
    out[dtype] = stats
  return out


@pytest.fixture(scope="module")
def update_program():
  """The packed update of the tiny model compiled for 2 H100s (fsdp=2), log-probs in 4
  chunks: (parsed module, number of devices)."""
  devices = _devices(2)
  with pytest.MonkeyPatch.context() as mp:
    # jax asks the local GPU for its compute capability (cuDNN's packed mode needs Hopper);
    # there is none here, so it is told the target's: an H100, 9.0.
    mp.setattr(fused_attention_stablehlo, "check_compute_capability",
               lambda c: tuple(map(int, c.split("."))) <= (9, 0))
    _, compiled = step_cases.update_case("tiny", 8, 256, devices=2, device_list=devices,
                                         return_compiled=True, logits_chunk=512,
                                         model_overrides=dict(attention=FUSED_ATTENTION))
  return hlo_stats.parse(compiled.as_text()), 2


@pytest.mark.parametrize("target", ["h100_sxm", "h800", "h200"])
def test_each_target_config_compiles_a_function_for_its_gpu(target):
  text = gpu.target_config(target)
  devices = _devices(1, target)
  kind = text.split('device_description_str: "')[1].split('"')[0]
  assert devices[0].device_kind == kind and devices[0].platform == "gpu"
  sh = jax.sharding.SingleDeviceSharding(devices[0])
  x = jax.ShapeDtypeStruct((64, 128), jnp.bfloat16, sharding=sh)
  compiled = jax.jit(lambda a, b: jax.nn.relu(a @ b)).lower(x, x.update(shape=(128, 96))
                                                             ).compile()
  module = hlo_stats.parse(compiled.as_text())
  # The GPU program: a Triton or cuBLAS matmul kernel, not the CPU's dot.
  kernels = [i for i, _, _ in module.executed()]
  assert any(i.opcode == "fusion" and "gemm" in (i.attrs + i.name) or
             (i.custom_call_target or "").startswith("__cublas") for i in kernels), kernels
  assert compiled.memory_analysis().output_size_in_bytes == 64 * 96 * 2


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_decode_loop_copies_no_stacked_weight_or_cache(decode_loops, dtype):
  stats = decode_loops[dtype]
  assert stats["copies"] == [], stats["copies"]


def test_rollout_decode_casts_no_weight_per_step(decode_loops):
  stats = decode_loops["float32"]
  assert stats["casts_per_step"] == 0, [c for c in stats["copies"] if c[3]]


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_decode_step_writes_under_a_tenth_of_what_it_reads(decode_loops, dtype):
  stats = decode_loops[dtype]
  assert stats["written_to_read"] < 0.1, (stats["written_to_read"], stats["top_writers"])


def test_decode_stats_count_the_real_loop(decode_loops):
  # Not vacuous: the loop found is the decode loop over the model's layers, and what a step
  # must read is the model's bf16 weights plus its cache.
  cfg = models.get_preset(PRESET, **LAYERS)
  for stats in decode_loops.values():
    assert stats["kernels_per_step"] > 5 * cfg.num_layers
    weights_gb = cfg.num_params() * 2 / 1e9
    assert weights_gb < stats["bytes_must_read_per_step_gb"] < 1.5 * weights_gb


def test_no_weight_gathered_inside_the_logprob_chunk_loop(update_program):
  module, n = update_program
  loops = hlo_stats.loops_with(module, "chunked_logprobs")
  assert loops, "no log-prob chunk loop found: did chunked_logprobs change its name?"
  inside = [c for w in loops for c in hlo_stats.loop_collectives(module, w, n)
            if c["kind"] in ("all-gather", "reduce-scatter")]
  assert inside == [], inside


def test_update_gathers_its_layers_over_fsdp(update_program):
  # The control of the check above: the collectives are found, with their group size.
  module, n = update_program
  gathers = [c for c in hlo_stats.collectives(module, n) if c["kind"] == "all-gather"]
  assert gathers and all(c["group_size"] == 2 for c in gathers)
  assert sum(c["received_bytes"] * c["times"] for c in gathers) > 0


def test_packed_update_runs_a_fused_attention_kernel(update_program):
  module, _ = update_program
  targets = {i.custom_call_target for i, _, _ in module.executed() if i.custom_call_target}
  assert any("fmha" in t or "flash" in t or "attention" in t for t in targets), targets


def test_prefill_chunks_the_reference_scores_the_way_the_gpu_bounds(monkeypatch):
  """The sampler's prefill of 16 prompts of 1024 tokens (Qwen3-0.6B's widths, 2 layers)
  takes the reference attention, whose scores (1 GiB) pass REFERENCE_MAX_SCORE_BYTES: the
  chunks XLA:GPU is compiled with (static slices, chosen by the lowering platform) need
  less than the whole scores and less than the loop XLA:CPU needs (which at 28 layers,
  64 prompts took 30.9 GB a GPU against 27.1 unchunked and 21.2 sliced)."""
  devices = _devices(1)
  chunked = attention.query_chunked
  total = {}
  for name, kwargs in (("default", {}), ("loop", dict(loop=True)),
                       ("whole", dict(max_score_bytes=1 << 40))):
    monkeypatch.setattr(attention, "query_chunked", functools.partial(chunked, **kwargs))
    jax.clear_caches()  # The prefill is traced again with this attention.
    total[name] = step_cases.prefill_case("qwen3_0p6b", 16, 1024, device_list=devices,
                                          model_overrides=dict(num_layers=2))["total_gb"]
  jax.clear_caches()
  assert total["default"] < total["loop"] and total["default"] < total["whole"], total


def _toy_decode(layers=3, d=256, batch=2, stacked=True, copy=False):
  """A decode-shaped toy: a while loop of unknown trip count over steps, each running the
  layers over weights stacked [L, D, D] (a scan) or one array per layer (unrolled).
  `copy`: the deliberately bad loop, which makes each layer's weight a buffer of its own."""
  devices = _devices(1)
  sh = jax.sharding.SingleDeviceSharding(devices[0])

  def layer(x, w):
    if copy:
      w = jax.lax.optimization_barrier(w)  # The slice must exist as its own buffer.
    return jnp.tanh(x @ w)

  def step(ws, x):
    if stacked:
      return jax.lax.scan(lambda h, w: (layer(h, w), None), x, ws)[0]
    for w in ws:
      x = layer(x, w)
    return x

  def loop(ws, x, n):
    return jax.lax.while_loop(lambda c: c[0] < n, lambda c: (c[0] + 1, step(ws, c[1])),
                              (0, x))[1]

  w = (jax.ShapeDtypeStruct((layers, d, d), jnp.bfloat16, sharding=sh) if stacked else
       tuple(jax.ShapeDtypeStruct((d, d), jnp.bfloat16, sharding=sh) for _ in range(layers)))
  x = jax.ShapeDtypeStruct((batch, d), jnp.bfloat16, sharding=sh)
  n = jax.ShapeDtypeStruct((), jnp.int32, sharding=sh)
  module = hlo_stats.parse(jax.jit(loop).lower(w, x, n).compile().as_text())
  named = {"w": ((layers, d, d), jnp.bfloat16)} if stacked else {
      f"w{i}": ((d, d), jnp.bfloat16) for i in range(layers)}
  targets = hlo_stats.copy_targets(named, layers)
  loop_instr = module.outer_loop()
  return (hlo_stats.copies(module, loop_instr, targets),
          hlo_stats.loop_summary(module, loop_instr, layers))


def test_the_check_catches_a_decode_loop_that_copies_a_stacked_weight():
  found, summary = _toy_decode(copy=True)
  assert found and {c["target"] for c in found} == {"w"}, found
  assert found[0]["writes"] == "bf16[256, 256]" or found[0]["writes"] == "bf16[1, 256, 256]"
  # Each layer's copy (128 KB) is written on every step: more than the step must read / 10.
  assert summary["bytes_written"] >= 3 * 256 * 256 * 2


def test_the_check_passes_per_layer_weights_read_in_place():
  found, summary = _toy_decode(stacked=False)
  assert found == [], found
  assert summary["bytes_written"] < 0.1 * 3 * 256 * 256 * 2


def test_gpu_compile_script_lists_its_cases():
  # The script imports the package (compiled.hlo_stats and step_cases among it) with flags
  # of its own, and names every case, the paper's model on 64 GPUs among them.
  root = str(pathlib.Path(__file__).parent.parent)
  env = dict(os.environ, PYTHONPATH=root)
  r = subprocess.run([sys.executable, os.path.join(root, "benchmarks", "gpu_compile.py"),
                      "--list", "--target=h800"], cwd=root, env=env, capture_output=True,
                     text=True, timeout=300)
  assert r.returncode == 0, r.stderr[-3000:]
  cases = r.stdout.split()
  assert {"update/qwen3_30b_a3b/main", "decode/qwen3_30b_a3b/b64", "decode/qwen3_1p7b/b256+f32",
          "prefill/qwen3_0p6b/b64x1024", "engine/qwen3_8b/s64x8192+ragged",
          "engine/qwen3_8b+qwen3_0p6b/s32x8192", "engine/gpu-config/s16x32768",
          "engine-prefill/qwen3_8b/u8x512-s64x8192"} <= set(cases), cases
  assert len(cases) == 44, cases


def test_ragged_decode_runs_one_pallas_kernel_a_layer_within_the_bars(decode_loops):
  # attention="ragged": the Pallas decode kernel (Triton, compiled here by XLA:GPU) reads
  # each row's own length; the loop keeps the bars of the XLA path it replaces.
  cfg = models.get_preset(PRESET, param_dtype="bfloat16", compute_dtype="bfloat16",
                          attention="ragged", **LAYERS)
  case, compiled = step_cases.decode_case(
      PRESET, ROWS, REACHED, MAX_LEN, model_overrides=dict(attention="ragged", **LAYERS),
      device_list=_devices(1), return_compiled=True)
  stats = hlo_stats.decode_step_stats(
      compiled.as_text(), cfg, ROWS, case["cache_len"],
      weights=_rollout_weights(cfg, qwen3.abstract_params(cfg)))
  assert stats["custom_calls_per_step"].get("__gpu$xla.gpu.triton") == cfg.num_layers
  assert stats["copies"] == [], stats["copies"]
  assert stats["written_to_read"] < 0.1, (stats["written_to_read"], stats["top_writers"])
  # As many kernels a layer as the XLA attention (the kernel, two for merging its parts);
  # here XLA also copies two [rows] int32 loop values a step (at 28 and 36 layers the
  # totals differ by 0 and 1: docs/results/ragged-attention.md).
  assert stats["kernels_per_step"] <= decode_loops["bfloat16"]["kernels_per_step"] + 2


@pytest.fixture(scope="module")
def engine_steps():
  """{(attention, layers): stats} of the engine's decode call compiled for an H100: a main
  and a sub-agent (Qwen3-0.6B's widths) stepping together, ROWS slots each of MAX_LEN
  positions, every row at REACHED tokens (the window it attends over)."""
  devices = _devices(1)
  out = {}
  for attention, layers in (("auto", 1), ("auto", 2), ("ragged", 1), ("ragged", 2)):
    _, compiled, lanes = step_cases.engine_decode_case(
        (PRESET, PRESET), ROWS, REACHED, MAX_LEN, attention=attention, device_list=devices,
        return_compiled=True, model_overrides=dict(num_layers=layers))
    text = compiled.as_text()
    out[attention, layers] = stats = hlo_stats.step_stats(text, lanes)
    # Kernels that copy a window's worth of a cache out (window < capacity here); the cache
    # as the step's in-place write leaves it too (XLA:GPU scatters bf16 as u16).
    window = step_cases.sampling.attention_window(REACHED, MAX_LEN)
    targets = {f"{m}{name}{as_}": (hlo_stats.Array(as_ or hlo_stats.array_of(shape, dt).dtype,
                                                   tuple(shape)),
                                   math.prod(shape) * window // MAX_LEN)
               for m, (_, _, cache, _) in enumerate(lanes)
               for name, (shape, dt) in hlo_stats.named_arrays(cache).items()
               for as_ in ("", "u16")}
    module = hlo_stats.parse(text)
    stats["window_copies"] = hlo_stats.copies(module, module.outer_loop(), targets)
  return out


@pytest.mark.parametrize("attention", ["auto", "ragged"])
def test_engine_decode_step_writes_under_a_tenth_of_what_it_reads(engine_steps, attention):
  stats = engine_steps[attention, 2]
  assert stats["copies"] == [], stats["copies"]
  assert stats["written_to_read"] < 0.1, (stats["written_to_read"], stats["top_writers"])
  # Not vacuous: what a step must read is both models' bf16 weights and their windows' KV.
  cfg = models.get_preset(PRESET, **LAYERS)
  assert 2 * cfg.num_params() * 2 / 1e9 < stats["bytes_must_read_per_step_gb"]
  if attention == "ragged":  # The Pallas kernel, once a layer of each model.
    assert stats["custom_calls_per_step"].get("__gpu$xla.gpu.triton") == 2 * cfg.num_layers


@pytest.mark.parametrize("attention", ["auto", "ragged"])
def test_engine_decode_step_runs_at_most_20_kernels_a_layer(engine_steps, attention):
  # The layers are unrolled: a step's kernels are affine in the depth. From 1 and 2 layers
  # a model, the count at Qwen3-0.6B's 28, over its 2 x 28 layers (sampling and heads
  # included), is within the bar.
  k1, k2 = (engine_steps[attention, n]["kernels_per_step"] for n in (1, 2))
  per_layer = (k2 - k1) / 2
  layers = models.get_preset(PRESET).num_layers
  assert 5 < per_layer <= 20, (k1, k2)
  assert (k2 + (layers - 2) * 2 * per_layer) / (2 * layers) <= 20, (k1, k2)


@pytest.mark.parametrize("attention", ["auto", "ragged"])
def test_engine_decode_step_reads_a_window_of_the_cache_in_place(engine_steps, attention):
  # Rows shorter than their lane's capacity attend over a window of it: read where it lies.
  found = engine_steps[attention, 2]["window_copies"]
  assert found == [], [(c["reads"], c["writes"], c["roots"]) for c in found]


@pytest.fixture(scope="module")
def shared_steps():
  """{(attention, layers, members): stats} of `engine_steps`' step with the slots also
  attending to a pool of shared prompts (`engine.slots.Pool`: 2 rows of REACHED positions),
  each row read by `members` slots: ROWS (a row may hold every slot) or 2 (fewer than the
  slots: a prompt's K rollouts, its members' queries gathered)."""
  out = {}
  # The XLA path's bytes at 2 layers; the Pallas path's bytes and kernels a layer (1 and 2).
  for attention, layers, members in (("auto", 2, ROWS), ("ragged", 1, ROWS),
                                     ("ragged", 2, ROWS), ("ragged", 1, 2), ("ragged", 2, 2)):
    _, compiled, lanes = step_cases.engine_decode_case(
        (PRESET, PRESET), ROWS, REACHED, MAX_LEN, attention=attention,
        device_list=_devices(1), return_compiled=True,
        model_overrides=dict(num_layers=layers), pool=(2, REACHED, members))
    out[attention, layers, members] = hlo_stats.step_stats(compiled.as_text(), lanes)
  return out


@pytest.mark.parametrize("attention,members", [("auto", ROWS), ("ragged", ROWS),
                                               ("ragged", 2)])
def test_engine_decode_step_with_shared_prompts_writes_under_a_tenth_of_what_it_reads(
    shared_steps, attention, members):
  # The cascade moves queries and outputs, not a copy of the pool.
  stats = shared_steps[attention, 2, members]
  assert stats["copies"] == [], stats["copies"]
  assert stats["written_to_read"] < 0.1, (stats["written_to_read"], stats["top_writers"])
  if attention == "ragged":  # Two Pallas kernels a layer of each model: prefix, own.
    cfg = models.get_preset(PRESET, **LAYERS)
    assert stats["custom_calls_per_step"].get("__gpu$xla.gpu.triton") == 4 * cfg.num_layers


@pytest.mark.parametrize("members", [ROWS, 2])
def test_engine_decode_step_with_shared_prompts_runs_at_most_20_kernels_a_layer(
    shared_steps, members):
  # The Pallas path, the GPU engine's (the XLA path's cascade takes two softmaxes of four
  # kernels each: docs/results/engine.md). Counted as `engine_steps`' are.
  k1, k2 = (shared_steps["ragged", n, members]["kernels_per_step"] for n in (1, 2))
  per_layer = (k2 - k1) / 2
  layers = models.get_preset(PRESET).num_layers
  assert 5 < per_layer <= 20, (k1, k2)
  assert (k2 + (layers - 2) * 2 * per_layer) / (2 * layers) <= 20, (k1, k2)
