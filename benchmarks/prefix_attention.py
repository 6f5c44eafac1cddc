"""One layer's decode attention with a shared-prefix pool against per-slot copies, compiled
for a GPU on a CPU-only machine.

Today every slot holds its prompt's KV and its own tokens, and a step's attention reads all
of it (`attention.attend` over the window: the XLA path; `ragged_attention.decode`: the
Pallas kernel). With a pool (`models/prefix_attention.py`) each prompt's KV is held once per
pool row and read once a step for all its member slots. Both are compiled for the target
(no GPU: no autotuning) at Qwen3-8B's attention shapes and read from the optimized HLO
(`compiled.hlo_stats`): kernels, bytes written (outputs; in-place updates count their
update), bytes of the kernels' operands, and the KV bytes a step must read. Results:
docs/results/engine.md ("Shared prompt KV").

  python benchmarks/prefix_attention.py --target=h100_sxm \\
      --out=benchmarks/results/prefix-attention-h100.json
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
import jax.numpy as jnp  # noqa: E402
from absl import app, flags  # noqa: E402

from mgrpo_jax import models, xla_options  # noqa: E402
from mgrpo_jax.compiled import gpu, hlo_stats  # noqa: E402
from mgrpo_jax.models import attention, prefix_attention, ragged_attention  # noqa: E402

_TARGET = flags.DEFINE_enum("target", "h100_sxm", gpu.TARGETS, "GPU to compile for.")
_PRESET = flags.DEFINE_string("preset", "qwen3_8b", "Model preset (its attention shapes).")
_SLOTS = flags.DEFINE_integer("slots", 64, "Decode slots.")
_POOL = flags.DEFINE_integer("pool", 8, "Pool rows (prompts held once).")
_MEMBERS = flags.DEFINE_integer("members", 8, "Member slots per pool row.")
_PREFIX = flags.DEFINE_integer("prefix", 2048, "Prompt (prefix) positions per pool row.")
_OWN = flags.DEFINE_integer("own", 2048, "Own (suffix) positions per slot.")
_OUT = flags.DEFINE_string("out", "", "Where to write JSON.")
# Other prefix / own splits of the same context, for the pool's cases only: the share of
# the context a pool holds sets how many queries read each position, and so the bytes of
# scores the XLA path writes per byte of KV it reads.
_SWEEP = flags.DEFINE_list("sweep", ["512:3584", "3584:512"],
                           "PREFIX:OWN splits to compile the shared-prefix cases at too.")

# Issue 35's bars for a decode step: bytes written at most 10% of those read, at most 20
# kernels per layer.
WRITTEN_TO_READ_BAR, KERNELS_PER_LAYER_BAR = 0.10, 20


def _stats(fn, args, device, kv_bytes: int) -> dict:
  """Kernels, bytes written and operand bytes of `fn` compiled for `device`."""
  on = jax.sharding.SingleDeviceSharding(device)
  spec = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=on) for a in args]
  t0 = time.perf_counter()
  compiled = jax.jit(fn, compiler_options=xla_options.decode("gpu")).lower(*spec).compile()
  module = hlo_stats.parse(compiled.as_text())
  runs = list(module.executed())
  written = sum(t * module.bytes_written(i, c) for i, t, c in runs)
  operands = sum(t * sum(a.bytes for a in module.reads_from(i, c)) for i, t, c in runs)
  calls = {}
  for i, t, _ in runs:
    if i.custom_call_target:
      calls[i.custom_call_target] = calls.get(i.custom_call_target, 0) + t
  by_kernel = sorted(((t * module.bytes_written(i, c), i) for i, t, c in runs),
                     key=lambda r: -r[0])
  return {"kernels": sum(t for _, t, _ in runs), "custom_calls": calls,
          "kv_must_read_mb": kv_bytes / 1e6, "bytes_written_mb": written / 1e6,
          "operand_bytes_mb": operands / 1e6, "written_to_kv_read": written / kv_bytes,
          "top_writers": [{"kernel": i.name, "roots": hlo_stats.fusion_roots(module, i),
                           "mb": b / 1e6, "shape": [f"{a.dtype}{list(a.dims)}"
                                                     for a in i.shape][:3]}
                          for b, i in by_kernel[:5]],
          "temp_mb": compiled.memory_analysis().temp_size_in_bytes / 1e6,
          "compile_s": round(time.perf_counter() - t0, 1)}


def cases(cfg, b: int, p: int, m: int, prefix: int, own: int):
  """{name: (function, abstract args, KV bytes a step must read)} of one layer."""
  kv, g, h, dt = cfg.num_kv_heads, cfg.num_heads // cfg.num_kv_heads, cfg.head_dim, jnp.bfloat16
  s = jax.ShapeDtypeStruct
  i32 = lambda *shape: s(shape, jnp.int32)
  q = s((b, kv, g, 1, h), dt)
  whole = prefix + own
  # Keys and values, 2 bytes each, per position and kv head.
  per_pos = 2 * kv * h * 2
  copies, shared = b * whole * per_pos, (p * prefix + b * own) * per_pos

  def today_xla(q, k_BxKxHxS, v, pos):
    # As qwen3.Attention: keys stored slots-minor, the swap folded into the matmul.
    return attention.attend(q, jnp.swapaxes(k_BxKxHxS, 2, 3), v, q_idx_BxT=pos,
                            kv_valid_BxS=jnp.ones((b, whole), bool), cached=True)

  def today_ragged(q, k, v, pos):
    return ragged_attention.decode(q, k, v, pos, window=whole)

  pool = (s((p, kv, h, prefix), dt), s((p, kv, prefix, h), dt), i32(p), i32(p, m), i32(b))
  pool_ragged = (s((p, kv, prefix, h), dt),) + pool[1:]
  return {
      "per_slot_copies/xla": (today_xla, (q, s((b, kv, h, whole), dt),
                                          s((b, kv, whole, h), dt), i32(b, 1)), copies),
      "shared_prefix/xla": (prefix_attention.cascade,
                            (q, s((b, kv, h, own), dt), s((b, kv, own, h), dt), i32(b))
                            + pool, shared),
      "per_slot_copies/ragged": (today_ragged, (q, s((b, kv, whole, h), dt),
                                                s((b, kv, whole, h), dt), i32(b, 1)), copies),
      "shared_prefix/ragged": (prefix_attention.cascade_ragged,
                               (q, s((b, kv, own, h), dt), s((b, kv, own, h), dt), i32(b))
                               + pool_ragged, shared)}


def main(argv):
  del argv
  cfg = models.get_preset(_PRESET.value, param_dtype="bfloat16", compute_dtype="bfloat16")
  b, p, m, prefix, own = (_SLOTS.value, _POOL.value, _MEMBERS.value, _PREFIX.value,
                          _OWN.value)
  device = gpu.devices(_TARGET.value, 1)[0]
  # The rest of a decode step reads every weight once per token: a layer's share of it.
  weights_per_layer = cfg.num_params() * 2 / cfg.num_layers
  results = {}
  for name, (fn, args, kv_bytes) in cases(cfg, b, p, m, prefix, own).items():
    r = results[name] = _stats(fn, args, device, kv_bytes)
    r["written_to_read_with_weights"] = r["bytes_written_mb"] * 1e6 / (
        kv_bytes + weights_per_layer)
    r["keeps_written_bar_alone"] = r["written_to_kv_read"] <= WRITTEN_TO_READ_BAR
    print(f"{name}: {r['kernels']:.0f} kernels, reads {r['kv_must_read_mb']:.1f} MB of KV, "
          f"writes {r['bytes_written_mb']:.1f} MB ({r['written_to_kv_read']:.3f} of the KV; "
          f"{r['written_to_read_with_weights']:.3f} with the layer's weights), custom calls "
          f"{r['custom_calls']}, compiled in {r['compile_s']} s", flush=True)
  sweep = {}
  for split in _SWEEP.value:
    pre, own_ = (int(x) for x in split.split(":"))
    for name, (fn, args, kv_bytes) in cases(cfg, b, p, m, pre, own_).items():
      if name.startswith("shared_prefix"):
        r = _stats(fn, args, device, kv_bytes)
        sweep[f"{name}/{split}"] = {k: r[k] for k in ("kernels", "kv_must_read_mb",
                                                      "bytes_written_mb", "written_to_kv_read")}
        print(f"{name} at {split}: {r['kernels']:.0f} kernels, writes "
              f"{r['written_to_kv_read']:.3f} of the KV it reads", flush=True)
  out = {"what": "one layer's decode attention compiled for a GPU on a CPU-only machine (no "
                 "autotuning): per-slot copies of the prompt's KV against a shared-prefix "
                 "pool (cascade attention); bytes from the optimized HLO, KV read modelled",
         "command": "python benchmarks/prefix_attention.py " + " ".join(sys.argv[1:]),
         "jax": jax.__version__, "target": _TARGET.value, "preset": _PRESET.value,
         "shapes": {"slots": b, "pool_rows": p, "members": m, "prefix": prefix, "own": own,
                    "kv_heads": cfg.num_kv_heads, "heads": cfg.num_heads,
                    "head_dim": cfg.head_dim, "dtype": "bfloat16"},
         "weights_per_layer_mb": weights_per_layer / 1e6,
         "bars": {"written_to_read": WRITTEN_TO_READ_BAR,
                  "kernels_per_layer": KERNELS_PER_LAYER_BAR},
         "cases": results, "prefix_own_sweep": sweep}
  if _OUT.value:
    with open(_OUT.value, "w") as f:
      json.dump(out, f, indent=1)


if __name__ == "__main__":
  app.run(main)
