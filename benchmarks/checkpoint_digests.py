"""Cost of verified checkpoints: sha256 of every file of a step, written and checked.

  python benchmarks/checkpoint_digests.py                  # 1 GiB state in a temp dir
  python benchmarks/checkpoint_digests.py --gib=4 --dir=/mnt/disk/tmp

Saves a float32 state of `--gib` GiB (16 arrays) with `checkpoint.Checkpointer`, then
times `write_digests` (what every save adds, in the background after orbax commits) and
`verify_digests` (what every restore adds before orbax reads) on the step. Files are in
the page cache here, so this is the hashing cost, not the disk's.
"""

import os
import shutil
import tempfile
import time

from absl import app, flags
import jax.numpy as jnp
import numpy as np

from mgrpo_jax import checkpoint

_GIB = flags.DEFINE_float("gib", 1.0, "State size in GiB.")
_DIR = flags.DEFINE_string("dir", None, "Scratch directory (default: a temp dir).")


def main(argv):
  del argv
  root = tempfile.mkdtemp(dir=_DIR.value)
  try:
    n = int(_GIB.value * 2**30 / 4 / 16)
    rng = np.random.default_rng(0)
    state = {f"w{i}": jnp.asarray(rng.standard_normal((n,), dtype=np.float32))
             for i in range(16)}
    with checkpoint.Checkpointer(root) as ckpt:
      t0 = time.perf_counter()
      ckpt.save(1, state, {})
      ckpt.wait()
      print(f"save (orbax + digests): {time.perf_counter() - t0:.2f} s")
    step = os.path.join(root, "1")
    gib = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(step)
              for f in fs) / 2**30
    for name, fn in (("write_digests", checkpoint.write_digests),
                     ("verify_digests", checkpoint.verify_digests)):
      t0 = time.perf_counter()
      fn(step)
      dt = time.perf_counter() - t0
      print(f"{name}: {dt:.2f} s for {gib:.2f} GiB = {dt / gib:.2f} s/GiB "
            f"({os.cpu_count()} CPUs)")
  finally:
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
  app.run(main)
