"""How long the packed train step takes per RL step, compiles included.

  python benchmarks/update_compiles.py --out=benchmarks/results/update-compiles-cpu.json

The sweep's M-GRPO runs spent 2612 s of 3957 updating (benchmarks/results/hierarchy-heldout-
cpu.json, seed 0), the frozen_sub runs 90 s: the sub-agent's batch (Q*K*D rows of aligned
episodes) packs into a different number of micro-batches M almost every step, and each new
[M, R, L] shape compiles the step again. This runs the step of the sweep's model (the cpu
size's `tiny_wide`, packed under `max_tokens_per_micro`) on `--steps` batches of `--rows`
rows whose lengths are drawn uniformly from [--min_len, --max_len] (a fixed seed), and
records each step's shape, whether it was new, and its wall time.
"""

import json
import os
import time

from absl import app, flags
import jax
import numpy as np

from mgrpo_jax.models import config as model_config_lib
from mgrpo_jax.rl import batch as batch_lib
from mgrpo_jax.rl import train_step as ts
from mgrpo_jax.models import qwen3
from configs import mgrpo as mgrpo_config

_OUT = flags.DEFINE_string("out", "", "Write the JSON here (default: print only).")
_STEPS = flags.DEFINE_integer("steps", 12, "RL steps (batches) to time.")
_ROWS = flags.DEFINE_integer("rows", 192, "Rows a batch (the cpu sweep's Q*K*D = 8*8*3).")
_MIN_LEN = flags.DEFINE_integer("min_len", 128, "Shortest episode, tokens.")
_MAX_LEN = flags.DEFINE_integer("max_len", 672, "Longest episode, tokens (limits.max_len).")
_VOCAB = flags.DEFINE_integer("vocab", 1024, "Vocabulary size (the sweep's tokenizer: ~1k).")


def _batch(rng, rows: int, lo: int, hi: int) -> batch_lib.Batch:
  t = hi
  lengths = rng.integers(lo, hi + 1, rows)
  tokens = rng.integers(1, _VOCAB.value, (rows, t)).astype(np.int32)
  on = np.arange(t)[None] < lengths[:, None]
  mask = (on & (np.arange(t)[None] >= lengths[:, None] // 2)).astype(np.float32)
  tokens = np.where(on, tokens, 0).astype(np.int32)
  return batch_lib.Batch(tokens=tokens, loss_mask=mask,
                         old_logp=np.where(mask > 0, -2.0, 0.0).astype(np.float32),
                         adv=rng.standard_normal(rows).astype(np.float32))


def main(argv):
  del argv
  c = mgrpo_config.get_config("task=multihop,runlocal,variant=mgrpo")
  mc = c.sub_model
  cfg = model_config_lib.get_preset(mc.preset, vocab_size=_VOCAB.value)
  params = qwen3.init_params(cfg, jax.random.key(0))
  tx = ts.make_optimizer(learning_rate=1e-4)
  state = ts.init_state(params, tx, jax.random.key(1))
  lcfg = ts.LossConfig(kind=c.sub_loss.kind, agg=c.sub_loss.agg)
  step = ts.make_train_step(cfg, lcfg, tx, max_tokens_per_micro=mc.max_tokens_per_micro)
  rng = np.random.default_rng(0)
  seen, rows = set(), []
  for i in range(_STEPS.value):
    batch = _batch(rng, _ROWS.value, _MIN_LEN.value, _MAX_LEN.value)
    packed = step.prepare(batch)
    shape = tuple(int(x) for x in packed.tokens.shape)
    t0 = time.perf_counter()
    state, metrics = step(state, batch)
    jax.block_until_ready(metrics)
    wall = time.perf_counter() - t0
    rows.append(dict(step=i, shape=list(shape), new_shape=shape not in seen,
                     wall_s=round(wall, 2), loss=float(metrics["loss"])))
    seen.add(shape)
    print(rows[-1], flush=True)
  walls = [r["wall_s"] for r in rows]
  out = dict(
      what="Wall time of the packed train step (sub-agent batch of the cpu sweep), compiles "
           "included, per RL step",
      command="python benchmarks/update_compiles.py " + " ".join(
          f"--{k}={flags.FLAGS[k].value}" for k in ("steps", "rows", "min_len", "max_len",
                                                   "vocab")),
      model=f"{mc.preset} (vocab {_VOCAB.value}), max_tokens_per_micro "
            f"{mc.max_tokens_per_micro}",
      machine=f"{os.cpu_count()} CPU cores", jax=jax.__version__,
      distinct_shapes=len(seen), total_s=round(sum(walls), 1),
      after_first_s=round(sum(walls[1:]), 1), steps=rows)
  print(json.dumps({k: v for k, v in out.items() if k != "steps"}, indent=1))
  if _OUT.value:
    with open(_OUT.value, "w") as f:
      json.dump(out, f, indent=1)


if __name__ == "__main__":
  app.run(main)
