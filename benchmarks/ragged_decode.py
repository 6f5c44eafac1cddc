"""The sampler's decode step with attention="ragged" beside the XLA path, compiled for a GPU.

Compiled on a CPU-only machine for a GPU target (as benchmarks/gpu_compile.py does): the
sampler's real decode loop (`sampling.decode_jit`) per attention, and from its optimized HLO
(`hlo_stats.decode_step_stats`) the kernels per layer, bytes written per step against the
bytes a step must read, the custom calls (one Pallas/Triton call per layer with "ragged").
Beside it, the KV slots each attention reads for a batch of rows of mixed lengths, from the
kernel's loop bounds (modelled, not measured: no GPU ran): the XLA path reads every row up to
the sampler's window (`sampling.attention_window` of the longest row), the ragged kernel each row up
to its length rounded up to the kernel's key block. Results: docs/results/ragged-attention.md.

  python benchmarks/ragged_decode.py --target=h200 --preset=qwen3_8b --rows=64 --cache=8192 \
      --out=benchmarks/results/ragged-decode-gpu-compile.json
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The CUDA plugin checks the installed CUDA libraries against a driver; there is none here.
os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")

import functools  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
from absl import app, flags  # noqa: E402

from mgrpo_jax.compiled import gpu, hlo_stats, step_cases  # noqa: E402
from mgrpo_jax import models, sampling  # noqa: E402
from mgrpo_jax.models import qwen3, ragged_attention  # noqa: E402

_PRESET = flags.DEFINE_string("preset", "qwen3_8b", "Model preset (models/config.py).")
_ROWS = flags.DEFINE_integer("rows", 64, "Decode rows.")
_CACHE = flags.DEFINE_integer("cache", 8192, "Cache slots per row (the rows reached this).")
_TARGET = flags.DEFINE_enum("target", "h100_sxm", gpu.TARGETS, "GPU to compile for.")
_SEED = flags.DEFINE_integer("seed", 0, "Seed of the modelled row lengths.")
_OUT = flags.DEFINE_string("out", "", "Where to write JSON.")


# The functions whose kernels are the decode step's attention (innermost frames in the HLO):
# the XLA path's, and the ragged kernel's with its merge of the parts.
_ATTENTION_FUNCTIONS = ("reference", "query_chunked", "split_kv", "blockwise", "decode",
                        "kernel", "decode_attn_unbatched")


def attention_kernels(text: str) -> float:
  """Kernels per decode step that the attention itself runs (not the cache write)."""
  module = hlo_stats.parse(text)
  runs = module.loop_kernels(module.outer_loop())
  frames = lambda i: module.frames.get(hlo_stats._frame_id(i), ())
  return sum(t for i, t, _ in runs if set(frames(i)) & set(_ATTENTION_FUNCTIONS))


def compiled_step(target: str, preset: str, rows: int, cache: int, attention: str) -> dict:
  """The decode loop's memory and per-step HLO figures with `attention`."""
  devices = gpu.devices(target, 1)
  overrides = {"attention": attention}
  out, compiled = step_cases.decode_case(preset, rows, cache, cache, device_list=devices,
                                         return_compiled=True, model_overrides=overrides)
  cfg = models.get_preset(preset, param_dtype="bfloat16", compute_dtype="bfloat16",
                          **overrides)
  weights = jax.eval_shape(functools.partial(sampling.decode_params, cfg),
                           qwen3.abstract_params(cfg))
  stats = hlo_stats.decode_step_stats(compiled.as_text(), cfg, rows, out["cache_len"],
                                      weights=weights)
  triton = stats["custom_calls_per_step"].get("__gpu$xla.gpu.triton", 0)
  return out | stats | {
      "attention": attention, "pallas_calls_per_layer": triton / cfg.num_layers,
      "attention_kernels_per_layer": attention_kernels(compiled.as_text()) / cfg.num_layers}


def slots_read(lengths, cache: int) -> dict:
  """KV slots one layer's attention reads for rows of `lengths` (each row's tokens so far)."""
  lengths = np.asarray(lengths)
  window = sampling.attention_window(int(lengths.max()), cache)
  _, block = ragged_attention.tiles(cache)
  ragged = ragged_attention.slots_read(lengths, cache)
  live = int(lengths.sum())
  return {"rows": len(lengths), "live": live, "longest": int(lengths.max()), "window": window,
          "xla_read": len(lengths) * window, "ragged_read": ragged, "key_block": block,
          "xla_read_over_live": len(lengths) * window / live,
          "ragged_read_over_live": ragged / live}


def length_profiles(rows: int, cache: int, seed: int) -> dict:
  """Row lengths of a batch: uniform over the cache, heavy-tailed (lognormal), one long row
  among short ones, and every row full."""
  rng = np.random.default_rng(seed)
  clip = lambda x: np.clip(np.asarray(x, int), 1, cache)
  one_long = np.full(rows, 300)
  one_long[0] = cache
  return {"uniform": clip(rng.integers(1, cache + 1, rows)),
          "lognormal_6.5_1": clip(np.exp(rng.normal(6.5, 1.0, rows))),
          "one_long_rest_300": one_long,
          "all_full": np.full(rows, cache)}


def main(argv):
  del argv
  preset, rows, cache, target = _PRESET.value, _ROWS.value, _CACHE.value, _TARGET.value
  cases = {}
  for attention in ("auto", "ragged"):
    t0 = time.perf_counter()
    r = compiled_step(target, preset, rows, cache, attention)
    r["wall_s"] = round(time.perf_counter() - t0, 1)
    cases[attention] = r
    print(f"{attention}: {r['kernels_per_layer']:.1f} kernels/layer "
          f"({r['attention_kernels_per_layer']:.1f} attention), writes "
          f"{r['bytes_written_per_step_gb']:.3f} GB of {r['bytes_must_read_per_step_gb']:.3f} GB "
          f"read ({r['written_to_read']:.3f}), {r['pallas_calls_per_layer']:.0f} Pallas "
          f"calls/layer, {r['total_gb']:.1f} GB, compiled in {r['compile_s']} s", flush=True)
  cfg = models.get_preset(preset)
  slot_bytes = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 2  # k and v, bf16.
  reads = {}
  for name, lengths in length_profiles(rows, cache, _SEED.value).items():
    r = reads[name] = slots_read(lengths, cache)
    r["xla_kv_gb_per_step"] = r["xla_read"] * slot_bytes / 1e9
    r["ragged_kv_gb_per_step"] = r["ragged_read"] * slot_bytes / 1e9
    # Bytes written per step over what the step then reads: the bf16 weights and the slots
    # each path reads for these rows (the compiled figure's denominator is the whole cache).
    for path, impl in (("xla", "auto"), ("ragged", "ragged")):
      read = cfg.num_params() * 2 / 1e9 + r[f"{path}_kv_gb_per_step"]
      r[f"{path}_written_to_read"] = cases[impl]["bytes_written_per_step_gb"] / read
    print(f"{name}: XLA reads {r['xla_read_over_live']:.2f}x the live slots, ragged "
          f"{r['ragged_read_over_live']:.2f}x; written / read {r['xla_written_to_read']:.3f} "
          f"and {r['ragged_written_to_read']:.3f}", flush=True)
  case = {"target": target, "preset": preset, "rows": rows, "cache": cache,
          "command": "python benchmarks/ragged_decode.py " + " ".join(sys.argv[1:]),
          "compiled": cases, "slots_read": reads}
  if _OUT.value:
    # One file, a case per (target, preset, rows, cache): later runs add theirs.
    results = {}
    if os.path.exists(_OUT.value):
      with open(_OUT.value) as f:
        results = json.load(f).get("cases", {})
    results[f"{target}/{preset}/b{rows}/s{cache}"] = case
    with open(_OUT.value, "w") as f:
      json.dump({"what": "the sampler's decode loop compiled for a GPU on a CPU-only machine "
                         "(no autotuning), XLA attention ('auto') against the Pallas ragged "
                         "kernel ('ragged'); slots read modelled from each path's loop bounds",
                 "jax": jax.__version__, "cases": results}, f, indent=1)


if __name__ == "__main__":
  app.run(main)
