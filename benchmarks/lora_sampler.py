"""What a LoRA agent's rollouts cost: the sampler with adapters on the fly vs a merged copy.

  python benchmarks/lora_sampler.py                       # CPU: the `small` preset
  python benchmarks/lora_sampler.py --preset=qwen3_0p6b   # GPU: a real shape, random weights

The sampler runs the adapted model as it is (x W + (x A) B s: two thin extra matmuls per
projection, no weight written). The alternative, merging W + s A B once per policy version,
costs a second copy of every targeted weight and the merge itself; this times both, greedy
decoding the same prompts, and writes benchmarks/results/lora-sampler-<device>.json.
"""

import argparse
import json
import os
import time

import jax
import numpy as np

from mgrpo_jax import models, sampling
from mgrpo_jax.models import lora


def _time(cfg, params, prompts, new_tokens, repeats=3):
  run = lambda: sampling.generate(cfg, params, prompts, max_new_tokens=new_tokens,
                                  temperature=0.0, key=jax.random.key(0))
  first = run()  # Compile.
  best = float("inf")
  for _ in range(repeats):
    start = time.perf_counter()
    res = run()
    best = min(best, time.perf_counter() - start)
  return best, first


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--preset", default="small")
  p.add_argument("--rank", type=int, default=16)
  p.add_argument("--batch", type=int, default=8)
  p.add_argument("--prompt_len", type=int, default=64)
  p.add_argument("--new_tokens", type=int, default=64)
  p.add_argument("--out", default="")
  a = p.parse_args()
  base_cfg = models.get_preset(a.preset)
  cfg = base_cfg.replace(lora_rank=a.rank, lora_alpha=2.0 * a.rank,
                         lora_targets=models.config.LORA_TARGETS)
  base = models.init_params(base_cfg, jax.random.key(0))
  adapters = lora.init_adapters(cfg, jax.random.key(1))
  keys = iter(jax.random.split(jax.random.key(2), 64))
  adapters = jax.tree.map(lambda x: x + 0.01 * jax.random.normal(next(keys), x.shape), adapters)
  rng = np.random.default_rng(0)
  prompts = [list(r) for r in rng.integers(1, base_cfg.vocab_size, (a.batch, a.prompt_len))]
  t_base, _ = _time(base_cfg, base, prompts, a.new_tokens)
  t_lora, res_lora = _time(cfg, lora.join(base, adapters), prompts, a.new_tokens)
  start = time.perf_counter()
  merged = jax.block_until_ready(lora.merged_params(cfg, lora.join(base, adapters)))
  t_merge = time.perf_counter() - start
  t_merged, res_merged = _time(base_cfg, merged, prompts, a.new_tokens)
  tokens = a.batch * a.new_tokens
  out = {
      "device": jax.devices()[0].device_kind, "preset": a.preset, "rank": a.rank,
      "batch": a.batch, "prompt_len": a.prompt_len, "new_tokens": a.new_tokens,
      "tokens_per_s": {"base": tokens / t_base, "lora_on_the_fly": tokens / t_lora,
                       "merged": tokens / t_merged},
      "merge_s": t_merge,
      "adapter_params": lora.num_adapter_params(cfg), "params": base_cfg.num_params(),
      "same_greedy_tokens": bool(np.array_equal(res_lora.tokens, res_merged.tokens)),
  }
  path = a.out or os.path.join(os.path.dirname(__file__), "results",
                               f"lora-sampler-{jax.default_backend()}.json")
  with open(path, "w") as f:
    json.dump(out, f, indent=1)
  print(json.dumps(out, indent=1))


if __name__ == "__main__":
  main()
