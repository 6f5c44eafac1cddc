"""How long the packed train step takes per RL step, compiles included.

  python benchmarks/update_compiles.py --out=benchmarks/results/update-compiles-cpu.json

The sweep's M-GRPO runs spent 2612 s of 3957 updating (experiments/hierarchy_ablation/results/
hierarchy-heldout-cpu.json, seed 0), the frozen_sub runs 90 s: the sub-agent's batch (Q*K*D rows of aligned
episodes) packs into a different number of micro-batches M almost every step, and each new
[M, R, L] shape compiles the step again. This runs the step of the sweep's model (the cpu
size's `tiny_wide`, packed under `max_tokens_per_micro`) on `--steps` batches of `--rows`
rows whose lengths are drawn uniformly from [--min_len, --max_len] (a fixed seed), and
records each step's shape, whether it was new, and its wall time.

  python benchmarks/update_compiles.py --copies=0.41 --compare_dedupe \
      --out=benchmarks/results/update-dedupe-cpu.json

`--copies` makes that share of each batch's rows copies of its other rows, as M-GRPO's
alignment repeats the calls of rollouts with fewer than D of them (`align/duplicate_rate`
was 0.41 in the cpu sweep's M-GRPO steps). `--compare_dedupe` runs the step that packs
copies once (the default) and the one that packs every row on each batch, one after the
other, and records both: the same batches, under the same load.
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
_COPIES = flags.DEFINE_float("copies", 0.0, "Share of a batch's rows that copy another row.")
_COMPARE = flags.DEFINE_bool("compare_dedupe", False, "Also time the step without the "
                             "packing of identical rows once (`dedupe_rows=False`).")


def _batch(rng, rows: int, lo: int, hi: int, copies: float = 0.0) -> batch_lib.Batch:
  t = hi
  distinct = max(1, rows - int(round(copies * rows)))
  lengths = rng.integers(lo, hi + 1, distinct)
  tokens = rng.integers(1, _VOCAB.value, (distinct, t)).astype(np.int32)
  on = np.arange(t)[None] < lengths[:, None]
  mask = (on & (np.arange(t)[None] >= lengths[:, None] // 2)).astype(np.float32)
  tokens = np.where(on, tokens, 0).astype(np.int32)
  adv = rng.standard_normal(distinct).astype(np.float32)
  # Every distinct row once, the copies drawn among them, in a random order (none: the
  # batches of `--copies=0` are those of update-compiles-cpu.json).
  idx = np.arange(rows) if distinct == rows else rng.permutation(np.concatenate(
      [np.arange(distinct), rng.integers(0, distinct, rows - distinct)]))
  return batch_lib.Batch(tokens=tokens[idx], loss_mask=mask[idx],
                         old_logp=np.where(mask > 0, -2.0, 0.0).astype(np.float32)[idx],
                         adv=adv[idx])


def main(argv):
  del argv
  c = mgrpo_config.get_config("task=multihop,runlocal,variant=mgrpo")
  mc = c.sub_model
  cfg = model_config_lib.get_preset(mc.preset, vocab_size=_VOCAB.value)
  tx = ts.make_optimizer(learning_rate=1e-4)
  lcfg = ts.LossConfig(kind=c.sub_loss.kind, agg=c.sub_loss.agg)
  modes = {"dedupe": True} | ({"every_row": False} if _COMPARE.value else {})
  steps = {m: ts.make_train_step(cfg, lcfg, tx, max_tokens_per_micro=mc.max_tokens_per_micro,
                                 dedupe_rows=d) for m, d in modes.items()}
  # Each mode its own weights (the step donates its state), the same values.
  states = {m: ts.init_state(qwen3.init_params(cfg, jax.random.key(0)), tx, jax.random.key(1))
            for m in modes}
  rng = np.random.default_rng(0)
  seen, rows = {m: set() for m in modes}, {m: [] for m in modes}
  for i in range(_STEPS.value):
    batch = _batch(rng, _ROWS.value, _MIN_LEN.value, _MAX_LEN.value, _COPIES.value)
    for m, step in steps.items():
      packed = step.prepare(batch)
      shape = tuple(int(x) for x in packed.tokens.shape)
      t0 = time.perf_counter()
      states[m], metrics = step(states[m], batch)
      jax.block_until_ready(metrics)
      wall = time.perf_counter() - t0
      rows[m].append(dict(step=i, shape=list(shape), new_shape=shape not in seen[m],
                          num_micro=int(packed.num_micro), wall_s=round(wall, 2),
                          loss=float(metrics["loss"])))
      seen[m].add(shape)
      print(m, rows[m][-1], flush=True)
  per_mode = {m: dict(distinct_shapes=len(seen[m]),
                      total_s=round(sum(r["wall_s"] for r in rows[m]), 1),
                      after_first_s=round(sum(r["wall_s"] for r in rows[m][1:]), 1),
                      steps=rows[m]) for m in modes}
  out = dict(
      what="Wall time of the packed train step (sub-agent batch of the cpu sweep), compiles "
           "included, per RL step",
      command="python benchmarks/update_compiles.py " + " ".join(
          f"--{k}={flags.FLAGS[k].value}" for k in ("steps", "rows", "min_len", "max_len",
                                                   "vocab", "copies", "compare_dedupe")),
      model=f"{mc.preset} (vocab {_VOCAB.value}), max_tokens_per_micro "
            f"{mc.max_tokens_per_micro}",
      machine=f"{os.cpu_count()} CPU cores", jax=jax.__version__,
      **(per_mode["dedupe"] if len(modes) == 1 else {"modes": per_mode}))
  print(json.dumps({m: {k: v for k, v in r.items() if k != "steps"}
                    for m, r in per_mode.items()}, indent=1))
  if _OUT.value:
    with open(_OUT.value, "w") as f:
      json.dump(out, f, indent=1)


if __name__ == "__main__":
  app.run(main)
