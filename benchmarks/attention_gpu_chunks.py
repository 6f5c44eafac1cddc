"""What XLA:GPU keeps of the chunked reference attention's scores, compiled without a GPU.

  JAX_PLATFORMS=cpu JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 python benchmarks/attention_gpu_chunks.py

One attention call (16 rows x 512 queries and keys, 2 kv heads x 2 queries, head dim 16,
float32: 128 MiB of scores) with a score budget of 8 MiB (16 chunks of 32 queries),
compiled for an H100 (`mgrpo_jax/compiled/gpu_targets/h100_sxm.txtpb`, deviceless), forward alone
and under `jax.grad`: the temporaries of the whole reference, of `attention.query_chunked`'s
static slices (GPU's way) and of its `lax.map` loop (CPU's way). Writes
`benchmarks/results/attention-gpu-chunks.json` (docs/results/gpu-compile.md, "Prefill").
"""

import functools
import json
import time

import jax
import jax.numpy as jnp
from absl import app, flags

from mgrpo_jax.compiled import gpu
from mgrpo_jax.models import attention

_OUT = flags.DEFINE_string("out", "benchmarks/results/attention-gpu-chunks.json",
                           "JSON to write.")
TARGET = "h100_sxm"
B, KV, G, T, H, BUDGET = 16, 2, 2, 512, 16, 8 << 20


def main(argv):
  del argv
  jax.config.update("jax_enable_compilation_cache", False)  # Deviceless: nothing to load.
  mesh = jax.sharding.Mesh(gpu.devices(TARGET, 1), ("x",))
  whole = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  spec = lambda shape, dtype=jnp.float32: jax.ShapeDtypeStruct(shape, dtype, sharding=whole)
  args = (spec((B, KV, G, T, H)), spec((B, KV, T, H)), spec((B, KV, T, H)),
          spec((B, T), jnp.int32), spec((B, T), jnp.bool_))
  kernels = {"whole": attention.reference,
             "slices": functools.partial(attention.query_chunked, max_score_bytes=BUDGET,
                                         loop=False),
             "loop": functools.partial(attention.query_chunked, max_score_bytes=BUDGET,
                                       loop=True)}
  modes = {"forward": lambda fn: fn,
           "grad": lambda fn: jax.grad(lambda q, k, v, i, m: jnp.sum(fn(q, k, v, i, m) ** 2),
                                       argnums=(0, 1, 2))}
  out = dict(shape=dict(rows=B, kv_heads=KV, groups=G, tokens=T, head_dim=H),
             scores_mib=B * KV * G * T * T * 4 / 2**20, budget_mib=BUDGET / 2**20,
             target=TARGET, jax=jax.__version__, temp_mib={})
  for mode, wrap in modes.items():
    for name, fn in kernels.items():
      t0 = time.perf_counter()
      mem = jax.jit(wrap(fn)).lower(*args).compile().memory_analysis()
      out["temp_mib"][f"{mode}/{name}"] = round(mem.temp_size_in_bytes / 2**20, 1)
      print(f"{mode:8s} {name:7s} {mem.temp_size_in_bytes / 2**20:8.1f} MiB "
            f"({time.perf_counter() - t0:.0f} s)", flush=True)
  with open(_OUT.value, "w") as f:
    json.dump(out, f, indent=1)


if __name__ == "__main__":
  app.run(main)
