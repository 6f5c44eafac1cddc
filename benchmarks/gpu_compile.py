"""The real update, decode and prefill steps compiled for a GPU on a CPU-only machine.

XLA:GPU's pipeline runs without a GPU (the `jax[cuda12]` wheels; no driver, no autotuning)
against a target config (`mgrpo_jax/compiled/gpu_targets/<target>.txtpb`: XLA's TargetConfig) and a
topology of such devices. Each case compiles the step training or sampling runs, with
abstract inputs (`mgrpo_jax.compiled.step_cases`' builders, memory.py's too), and reads the
GPU program: `memory_analysis()` per device and the optimized HLO (`compiled.hlo_stats`): kernels and
the bytes they write per decode step, custom calls (cuBLAS, cuDNN attention), collectives and
the bytes each GPU receives. Definitions and results: docs/results/gpu-compile.md.

  python benchmarks/gpu_compile.py --target=h100_sxm  # -> benchmarks/results/gpu-compile-h100_sxm.json
  python benchmarks/gpu_compile.py --target=h800 --cases=update/qwen3_30b_a3b
  python benchmarks/gpu_compile.py --list

Cases (the update's shapes and policy are memory.py's: bf16 compute over f32 master weights
and Adam moments, remat, packed 32k-token micro-batches per GPU, chunked log-probs):
  update/<preset>/{main,sub}   0.6B and 1.7B on one GPU, 8B on 8 (fsdp), 30B-A3B on 64
                               (fsdp 8 x expert 8: eight nodes of eight)
  decode/<preset>/b<rows>      the sampler's decode loop (`sampling.decode_jit`, with the
                               project's GPU compiler options) for rows whose traces reached
                               1024 tokens (max_len 32768), from bf16 weights;
  decode/<preset>/b<rows>+f32  the same from the float32 master weights the `gpu` config's
                               rollouts decode from
  prefill/<preset>/b<rows>x<t> the sampler's prefill of rows of t prompt tokens
  engine/<presets>/s<slots>x<capacity>[@w<window>][+ragged]
                               the agent engine's decode call (`engine.slots.decode_jit`),
                               those models' slots stepping together, every row at the
                               capacity (or at the window); `+ragged`: attention="ragged"
  engine/gpu-config/...        the same for the `gpu` config's two Qwen3-0.6B lanes
  engine-prefill/qwen3_8b/u<units>x<width>-s<slots>x<capacity>[+ragged]
                               the engine's prefill of units of width tokens into slots
  python benchmarks/gpu_compile.py --target=h200 --cases=engine \\
      --out=benchmarks/results/engine-gpu-compile-h200.json
"""

import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The CUDA plugin checks the installed CUDA libraries against a driver; there is none here.
os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")

import functools  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
from absl import app, flags  # noqa: E402

from mgrpo_jax import models, sampling, sharding  # noqa: E402
from mgrpo_jax.compiled import gpu, hlo_stats, step_cases  # noqa: E402
from mgrpo_jax.models import qwen3  # noqa: E402

TARGETS, LINKS = gpu.TARGETS, gpu.LINKS
GB = 1e9


def gpu_devices(target: str, count: int):
  return gpu.devices(target, count)


def fsdp_minimum(preset: str, mesh_axes: dict, micro_batches: int, devices) -> float:
  """Bytes one GPU must receive per update step under FSDP: per micro-batch each bf16 weight
  all-gathered three times (forward, remat, backward) and each f32 gradient reduce-scattered
  once, over the fsdp axis (ring volumes, (n-1)/n of the gathered size). Weights the expert
  axis splits are gathered only over fsdp; gradient reductions over other axes (data
  parallelism across expert groups) are not counted."""
  cfg = step_cases.model_config(preset)
  mesh, _ = step_cases.case_mesh(mesh_axes, devices)
  params = qwen3.abstract_params(cfg)
  shardings = sharding.param_shardings(params, mesh)
  total = 0.0
  for leaf, sh in zip(jax.tree.leaves(params), jax.tree.leaves(shardings)):
    axes = [a for part in sh.spec if part for a in ((part,) if isinstance(part, str) else part)]
    other = math.prod(mesh.shape[a] for a in axes if a != "fsdp")
    n = mesh.shape["fsdp"] if "fsdp" in axes else 1
    gathered = math.prod(leaf.shape) / other
    total += (n - 1) / n * gathered * (3 * 2 + 4)
  return total * micro_batches


def _custom_calls(module) -> dict:
  """{custom call target (cuBLAS, cuDNN attention, ...): calls per run of `module`}."""
  calls = {}
  for instr, times, _ in module.executed():
    if instr.custom_call_target:
      calls[instr.custom_call_target] = calls.get(instr.custom_call_target, 0) + times
  return calls


def update(target: str, preset: str, role: str, count: int, mesh_axes: dict | None = None,
           moe_chunk: int = 0) -> dict:
  rows, length = {"main": (16, 32768), "sub": (64, 8192)}[role]
  devices = gpu_devices(target, count)
  axes = mesh_axes or dict(data=1, fsdp=count, tensor=1)
  out, compiled = step_cases.update_case(preset, rows, length, devices=count, mesh_axes=axes,
                                         moe_chunk=moe_chunk, device_list=devices,
                                         return_compiled=True)
  t0 = time.perf_counter()
  text = compiled.as_text()
  module = hlo_stats.parse(text)
  node_of = [d.process_index for d in devices[:count]]
  colls = hlo_stats.collectives(module, count, node_of)
  links = LINKS[target]
  received = sum(c["times"] * c["received_bytes"] for c in colls)
  by_kind, link_s = {}, 0.0
  for c in colls:
    b = c["times"] * c["received_bytes"]
    by_kind[c["kind"]] = by_kind.get(c["kind"], 0.0) + b / GB
    link_s += b / links["infiniband" if c["crosses_nodes"] else "nvlink"]
  chunk_loops = hlo_stats.loops_with(module, "chunked_logprobs")
  # A chunk loop's own collectives times its trip count (the loop runs that many times per
  # micro-batch) and the micro-batches.
  in_chunks = sum(c["received_bytes"] * c["times"] * (w.trip_count or 1)
                  for w in chunk_loops for c in hlo_stats.loop_collectives(module, w, count))
  minimum = fsdp_minimum(preset, axes, out["micro_batches"], devices) if count > 1 else 0.0
  out.update(
      kernels_per_step=sum(t for _, t, _ in module.executed()),
      custom_calls=_custom_calls(module),
      collectives={
          "received_gb_per_step": received / GB,
          "by_kind_gb": by_kind,
          "in_logprob_chunk_loops_gb": in_chunks * out["micro_batches"] / GB,
          "fsdp_minimum_gb": minimum / GB,
          "ratio_to_minimum": received / minimum if minimum else None,
          "link_s": link_s,
          "links_gb_s": {k: v / GB for k, v in links.items()},
          "crosses_nodes_gb": sum(c["times"] * c["received_bytes"] for c in colls
                                  if c["crosses_nodes"]) / GB,
          "largest": sorted(({k: c[k] for k in ("kind", "times", "group_size", "arrays",
                                                "crosses_nodes")}
                             | {"received_gb": c["times"] * c["received_bytes"] / GB}
                             for c in colls), key=lambda c: -c["received_gb"])[:6]},
      analysis_s=round(time.perf_counter() - t0, 1))
  return out


def decode(target: str, preset: str, rows: int, param_dtype: str = "bfloat16",
           reached: int = 1024, max_len: int = 32768, count: int = 1,
           mesh_axes: dict | None = None) -> dict:
  """The sampler's decode loop on `count` GPUs (`mesh_axes`; default one GPU)."""
  devices = gpu_devices(target, count)
  out, compiled = step_cases.decode_case(preset, rows, reached, max_len, mesh_axes,
                                         param_dtype=param_dtype, device_list=devices,
                                         return_compiled=True)
  t0 = time.perf_counter()
  cfg = models.get_preset(preset, param_dtype=param_dtype, compute_dtype="bfloat16")
  # What the loop reads its weights from: the sampler's per-layer compute-dtype copies.
  weights = jax.eval_shape(functools.partial(sampling.decode_params, cfg),
                           qwen3.abstract_params(cfg))
  out.update(param_dtype=param_dtype, devices=count,
             **hlo_stats.decode_step_stats(compiled.as_text(), cfg, rows, out["cache_len"],
                                           weights=weights),
             analysis_s=round(time.perf_counter() - t0, 1))
  return out


def prefill(target: str, preset: str, rows: int, length: int,
            model_overrides: dict | None = None) -> dict:
  """The sampler's prefill (`sampling.prefill_rows`) of `rows` prompts of `length` tokens
  (`model_overrides`: fields of the preset's config, e.g. fewer layers)."""
  out, compiled = step_cases.prefill_case(preset, rows, length,
                                          device_list=gpu_devices(target, 1),
                                          return_compiled=True, model_overrides=model_overrides)
  module = hlo_stats.parse(compiled.as_text())
  out.update(kernels=sum(t for _, t, _ in module.executed()), custom_calls=_custom_calls(module))
  return out


def memory_gb(target: str) -> float:
  """The target GPU's memory (its TargetConfig's `device_memory_size`), in GB."""
  return gpu.memory_bytes(target) / GB


def engine_decode(target: str, presets: tuple, slots: int, capacity: int,
                  attention: str = "auto", reached: int | None = None) -> dict:
  """The engine's decode call (`engine.slots.decode_jit`): the models of `presets` stepping
  together on one GPU, `slots` slots of `capacity` positions each, every row at `reached`
  tokens (default: the capacity, attention's widest window)."""
  out, compiled, models_ = step_cases.engine_decode_case(
      presets, slots, reached or capacity, capacity, attention=attention,
      device_list=gpu_devices(target, 1), return_compiled=True)
  t0 = time.perf_counter()
  text = compiled.as_text()
  module = hlo_stats.parse(text)
  inside = {id(i) for i, _, _ in module.loop_kernels(module.outer_loop())}
  # What a call writes around its steps (e.g. a cache re-laid out for the loop and back).
  around = [(t * module.bytes_written(i, c), i) for i, t, c in module.executed()
            if id(i) not in inside]
  out.update(**hlo_stats.step_stats(text, models_),
             bytes_written_per_call_outside_steps_gb=sum(b for b, _ in around) / GB,
             top_writers_outside_steps=[
                 {"kernel": i.name, "roots": hlo_stats.fusion_roots(module, i), "bytes": b,
                  "writes": [f"{a.dtype}{list(a.dims)}" for a in i.shape][:2]}
                 for b, i in sorted(around, key=lambda r: -r[0])[:4]],
             gpu_memory_gb=memory_gb(target), analysis_s=round(time.perf_counter() - t0, 1))
  out["fits"] = out["total_gb"] <= out["gpu_memory_gb"]
  return out


def _written_under(module, function: str) -> float:
  """Bytes the kernels whose source stack passes through `function` (or a function defined
  in it) write, times their runs."""
  named = lambda f: f == function or f.startswith(function + ".")
  return sum(t * module.bytes_written(i, c) for i, t, c in module.executed()
             if any(named(f) for f in module.frames.get(hlo_stats._frame_id(i), ())))


def engine_prefill(target: str, preset: str, units: int, width: int, slots: int,
                   capacity: int, attention: str = "auto") -> dict:
  """The engine's prefill (`engine.slots.prefill`) of `units` chunks of `width` tokens into
  slots of `capacity` positions, over the widest window: the bytes its kernels write, and
  of them what copies the units' rows into their own batch (`slots._rows`), writes the
  new positions back (`slots._put`) and blocks keys and values for the attention."""
  out, compiled = step_cases.engine_prefill_case(
      preset, units, width, slots, capacity, capacity, attention=attention,
      device_list=gpu_devices(target, 1), return_compiled=True)
  module = hlo_stats.parse(compiled.as_text())
  runs = list(module.executed())
  written = sum(t * module.bytes_written(i, c) for i, t, c in runs)
  top = sorted(((t * module.bytes_written(i, c), i) for i, t, c in runs), key=lambda r: -r[0])
  out.update(kernels=sum(t for _, t, _ in runs), custom_calls=_custom_calls(module),
             bytes_written_gb=written / GB,
             rows_copy_written_gb=_written_under(module, "_rows") / GB,
             write_back_written_gb=_written_under(module, "_put") / GB,
             # The blockwise attention's key and value blocks, moved first (a copy).
             attention_blocks_written_gb=_written_under(module, "_blocked") / GB,
             top_writers=[{"kernel": i.name, "roots": hlo_stats.fusion_roots(module, i),
                           "bytes": b, "op": i.op_name[-120:]} for b, i in top[:6]],
             gpu_memory_gb=memory_gb(target))
  out["fits"] = out["total_gb"] <= out["gpu_memory_gb"]
  return out


def engine_cases(target: str) -> dict:
  """The engine's decode and prefill at Qwen3-8B's size, and the `gpu` config's lanes."""
  cases = {}
  for att in ("auto", "ragged"):
    tag = "" if att == "auto" else "+ragged"
    # 8B x 64 slots x 8192 holds 77 GB of KV: an H200's; 32 slots fit an H100.
    for presets, slots in ((("qwen3_8b",), 64), (("qwen3_8b",), 32),
                           (("qwen3_8b", "qwen3_8b"), 32), (("qwen3_8b", "qwen3_0p6b"), 32),
                           (("qwen3_8b", "qwen3_0p6b"), 16)):
      name = f"engine/{'+'.join(presets)}/s{slots}x8192{tag}"
      cases[name] = lambda p=presets, n=slots, a=att: engine_decode(target, p, n, 8192, a)
    # The `gpu` config (configs/mgrpo.py:gpu): two Qwen3-0.6B lanes of 16 slots each (one
    # per episode of 2 x 8), their caches grown to the 32k context, and at 8k; and 8 slots
    # each at 32k (what `kv_cache_budget_bytes` = 32 GB allows a lane).
    for slots, cap in ((16, 32768), (16, 8192), (8, 32768)):
      cases[f"engine/gpu-config/s{slots}x{cap}{tag}"] = lambda n=slots, c=cap, a=att: (
          engine_decode(target, ("qwen3_0p6b", "qwen3_0p6b"), n, c, a))
    # Rows shorter than the lane's capacity (grown for a longer episode): a window of 1024.
    cases[f"engine/qwen3_8b/s64x8192@w1024{tag}"] = lambda a=att: engine_decode(
        target, ("qwen3_8b",), 64, 8192, a, reached=1024)
    cases[f"engine/gpu-config/s16x8192@w1024{tag}"] = lambda a=att: engine_decode(
        target, ("qwen3_0p6b", "qwen3_0p6b"), 16, 8192, a, reached=1024)
    cases[f"engine-prefill/qwen3_8b/u8x512-s64x8192{tag}"] = lambda a=att: engine_prefill(
        target, "qwen3_8b", 8, 512, 64, 8192, a)
  return cases


def all_cases(target: str) -> dict:
  cases = {}
  for preset, count in (("qwen3_0p6b", 1), ("qwen3_1p7b", 1), ("qwen3_8b", 8)):
    for role in ("main", "sub"):
      cases[f"update/{preset}/{role}"] = lambda p=preset, r=role, n=count: update(
          target, p, r, n)
  for role in ("main", "sub"):
    cases[f"update/qwen3_30b_a3b/{role}"] = lambda r=role: update(
        target, "qwen3_30b_a3b", r, 64, step_cases.MOE_MESH, 512)
  for preset in ("qwen3_0p6b", "qwen3_1p7b"):
    for rows in (1, 64, 256):
      cases[f"decode/{preset}/b{rows}"] = lambda p=preset, b=rows: decode(target, p, b)
      cases[f"decode/{preset}/b{rows}+f32"] = lambda p=preset, b=rows: decode(
          target, p, b, "float32")
  # The paper's model on 64 GPUs, one row per GPU (memory.py's 64-device decode case).
  cases["decode/qwen3_30b_a3b/b64"] = lambda: decode(
      target, "qwen3_30b_a3b", 64, count=64, mesh_axes=step_cases.MOE_MESH)
  cases["prefill/qwen3_0p6b/b64x1024"] = lambda: prefill(target, "qwen3_0p6b", 64, 1024)
  return cases | engine_cases(target)


def main(argv):
  del argv
  target = _TARGET.value
  cases = all_cases(target)
  if _LIST.value:
    print("\n".join(cases))
    return
  chosen = [n for n in cases if any(n == c or n.startswith(c) for c in _CASES.value)]
  if not chosen:
    sys.exit(f"--cases={','.join(_CASES.value)} matches none of: {', '.join(cases)}")
  path = _OUT.value or f"benchmarks/results/gpu-compile-{target}.json"
  results = {}
  if os.path.exists(path):
    with open(path) as f:
      results = json.load(f).get("cases", {})
  for name in chosen:
    print(f"{name} ...", flush=True)
    t0 = time.perf_counter()
    r = results[name] = cases[name]()
    r["command"] = "python benchmarks/gpu_compile.py " + " ".join(sys.argv[1:])
    r["wall_s"] = round(time.perf_counter() - t0, 1)
    line = f"  total {r['total_gb']:.2f} GB per GPU, compiled in {r['compile_s']} s"
    if "fits" in r:
      line += f" of {r['gpu_memory_gb']:.1f} (fits: {r['fits']})"
    if "written_to_read" in r:
      line += (f"; per step {r['kernels_per_step']:.0f} kernels, writes "
               f"{r['bytes_written_per_step_gb']:.3f} GB, must read "
               f"{r['bytes_must_read_per_step_gb']:.3f} GB")
    if "collectives" in r:
      c = r["collectives"]
      line += (f"; receives {c['received_gb_per_step']:.1f} GB per GPU per step "
               f"(FSDP minimum {c['fsdp_minimum_gb']:.1f}), {c['link_s']:.2f} s at the link")
    print(line, flush=True)
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
      json.dump({"device": f"{target} (compiled on a CPU-only machine for this target; "
                           "per GPU; no autotuning)",
                 "target_config": f"mgrpo_jax/compiled/gpu_targets/{target}.txtpb",
                 "jax": jax.__version__, "cases": results}, f, indent=1)


if __name__ == "__main__":
  # Flags only when run: memory.py has some of the same names, and tests load both.
  _TARGET = flags.DEFINE_enum("target", "h100_sxm", TARGETS, "GPU to compile for.")
  _CASES = flags.DEFINE_list("cases", ["update", "decode", "prefill"],
                             "Case name prefixes to run (update, decode, prefill, engine, or "
                             "full names).")
  _OUT = flags.DEFINE_string("out", "", "Where to write JSON (default "
                             "benchmarks/results/gpu-compile-<target>.json).")
  _LIST = flags.DEFINE_bool("list", False, "List the cases and exit.")
  app.run(main)
