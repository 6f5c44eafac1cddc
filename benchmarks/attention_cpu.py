"""Attention kernels on this CPU: the reference against blockwise tiles, by rows and length.

  python benchmarks/attention_cpu.py --out=benchmarks/results/attention-cpu.json

Times one layer's attention (Qwen3-shaped heads of the CPU agents, `tiny_wide`: 2 kv heads x
2 queries each, head dim 64, float32), the best of `--repeats` calls after a warm-up:
`grad` (the train step: output and gradients, packed rows of three sequences each) and
`forward` (the sampler's prefill: unpacked causal rows). What `attention.resolve("auto")`
and `attention.CPU_BLOCK` are set from (docs/training.md, "Attention on CPU").
"""

import json
import os
import platform
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from mgrpo_jax.models import attention

_OUT = flags.DEFINE_string("out", "benchmarks/results/attention-cpu.json", "JSON to write.")
_REPEATS = flags.DEFINE_integer("repeats", 5, "Timed calls per case (the best is kept).")
_BLOCKS = flags.DEFINE_list("blocks", ["128", "256", "512"], "Blockwise tile sizes.")
KV, G, H = 2, 2, 64
# (mode, rows, tokens): about 4k-64k tokens a case, as a micro-batch or prefill holds.
CASES = [("grad", 32, 128), ("grad", 16, 256), ("grad", 8, 512), ("grad", 4, 1024),
         ("forward", 64, 128), ("forward", 64, 256), ("forward", 64, 512)]


def _inputs(rows: int, t: int, packed: bool):
  rng = np.random.default_rng(0)
  q = jnp.asarray(rng.normal(size=(rows, KV, G, t, H)), jnp.float32)
  k, v = (jnp.asarray(rng.normal(size=(rows, KV, t, H)), jnp.float32) for _ in range(2))
  idx = jnp.broadcast_to(jnp.arange(t), (rows, t))
  valid = jnp.ones((rows, t), bool)
  seg = None
  if packed:  # Three sequences a row, then padding (segment 0).
    seg = np.zeros((rows, t), np.int32)
    seg[:, :t // 3], seg[:, t // 3:2 * (t // 3)] = 1, 2
    seg[:, 2 * (t // 3):2 * (t // 3) + t // 4] = 3
    seg = jnp.asarray(seg)
  return (q, k, v), (idx, valid, seg)


def _best(fn, args, repeats: int) -> float:
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - t0)
  return min(times)


def run_case(mode: str, rows: int, t: int, blocks, repeats: int) -> dict:
  (q, k, v), (idx, valid, seg) = _inputs(rows, t, packed=mode == "grad")
  kernels = {"reference": lambda q, k, v: attention.query_chunked(q, k, v, idx, valid, seg,
                                                                   seg)}
  for b in blocks:
    kernels[f"blockwise{b}"] = lambda q, k, v, b=b: attention.blockwise(
        q, k, v, idx, valid, seg, seg, block_q=b, block_kv=b)
  out = dict(mode=mode, rows=rows, tokens=t, ms={})
  for name, fn in kernels.items():
    if mode == "grad":
      fn = jax.grad(lambda q, k, v, fn=fn: jnp.sum(fn(q, k, v) ** 2), argnums=(0, 1, 2))
    out["ms"][name] = round(1000 * _best(jax.jit(fn), (q, k, v), repeats), 1)
  print(f"{mode:8s} {rows:3d} x {t:5d}: " + ", ".join(f"{k} {v} ms"
                                                     for k, v in out["ms"].items()), flush=True)
  return out


def main(argv):
  del argv
  blocks = [int(b) for b in _BLOCKS.value]
  cases = [run_case(m, r, t, blocks, _REPEATS.value) for m, r, t in CASES]
  record = dict(
      what="One layer's attention on CPU (tiny_wide heads, float32): the reference against "
           "blockwise tiles; best of --repeats calls, milliseconds",
      command=" ".join(["python", "benchmarks/attention_cpu.py"] + sys.argv[1:]),
      machine=dict(cpus=os.cpu_count(), platform=platform.platform(), jax=jax.__version__,
                   loadavg_at_end=[round(x, 2) for x in os.getloadavg()]),
      cases=cases)
  os.makedirs(os.path.dirname(os.path.abspath(_OUT.value)), exist_ok=True)
  with open(_OUT.value, "w") as f:
    json.dump(record, f, indent=1)
  print(_OUT.value)


if __name__ == "__main__":
  app.run(main)
