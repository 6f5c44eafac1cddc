"""A sweep's finished warm starts, kept in the repository so that a new machine goes on.

A session may begin on a fresh machine: only what is committed survives it (session 15 found
`/work/sweep` gone, and with it the main + sub warm start, about two hours on 2 cores). What a
run reads of a warm start is small: its final weights (`hf/<agent>`, about 1 MB per agent at
the CPU size), and what the sweep reports of it, its `done.json` (config, commit, wall time)
and `metrics.jsonl` (its evaluations). `save` copies those into the archive once the warm
start has finished; `restore` puts them back into a workdir that holds none of its own, where
`--reuse` then checks their config and commit as for any finished run. `digest` names the
weights, so that every RL run records which warm start it started from.
"""

import hashlib
import json
import os
import shutil

KEPT = ("done.json", "metrics.jsonl", "config.json", "hf")  # What a run or the JSON reads.
DIGEST_FILE = "archive.json"
# A warm start larger than this (the GPU size's models) belongs on a persistent disk.
MAX_BYTES = 64 * 2**20


def digest(workdir: str) -> str:
  """sha256 of the final weights under `workdir/hf` (every file's path and bytes)."""
  root, h = os.path.join(workdir, "hf"), hashlib.sha256()
  if not os.path.isdir(root):
    raise FileNotFoundError(f"{root}: no final weights (the warm start has not finished).")
  for dirpath, dirnames, filenames in os.walk(root):
    dirnames.sort()
    for name in sorted(filenames):
      path = os.path.join(dirpath, name)
      h.update(os.path.relpath(path, root).encode() + b"\0")
      with open(path, "rb") as f:
        h.update(f.read())
  return h.hexdigest()


def _size(path: str) -> int:
  if os.path.isfile(path):
    return os.path.getsize(path)
  return sum(os.path.getsize(os.path.join(d, n)) for d, _, ns in os.walk(path) for n in ns)


def save(workdir: str, archive: str) -> str | None:
  """Copies a finished warm start's KEPT files to `archive/<basename(workdir)>`, replacing an
  older copy whole (written beside it, then renamed). Returns the weights' digest, or None
  when the files exceed MAX_BYTES (nothing is written)."""
  if not os.path.exists(os.path.join(workdir, "done.json")):
    raise FileNotFoundError(f"{workdir}: no done.json; only a finished warm start is archived.")
  kept = [n for n in KEPT if os.path.exists(os.path.join(workdir, n))]
  if sum(_size(os.path.join(workdir, n)) for n in kept) > MAX_BYTES:
    return None
  dest = os.path.join(archive, os.path.basename(os.path.normpath(workdir)))
  tmp = dest + ".tmp"
  shutil.rmtree(tmp, ignore_errors=True)
  os.makedirs(tmp)
  for name in kept:
    src = os.path.join(workdir, name)
    (shutil.copytree if os.path.isdir(src) else shutil.copy2)(src, os.path.join(tmp, name))
  weights = digest(tmp)
  with open(os.path.join(tmp, DIGEST_FILE), "w") as f:
    json.dump({"digest": weights, "from": os.path.abspath(workdir)}, f, indent=1)
  shutil.rmtree(dest, ignore_errors=True)
  os.replace(tmp, dest)
  return weights


def restore(archive: str, workdir: str) -> bool:
  """Copies `archive/<basename(workdir)>` into `workdir` when the workdir holds no warm start
  of its own (no done.json nor progress.json); False when there was nothing to restore.
  Raises ValueError when the copied weights are not the archived ones."""
  src = os.path.join(archive, os.path.basename(os.path.normpath(workdir)))
  if not os.path.exists(os.path.join(src, "done.json")):
    return False
  if any(os.path.exists(os.path.join(workdir, n)) for n in ("done.json", "progress.json")):
    return False
  # Without either file the workdir holds nothing a run made (one always begins with
  # progress.json), e.g. a restore cut short.
  shutil.rmtree(workdir, ignore_errors=True)
  os.makedirs(workdir)
  # done.json last: a restore cut short leaves no finished-looking warm start.
  for name in sorted(KEPT, key=lambda n: n == "done.json"):
    path = os.path.join(src, name)
    if name == "done.json":
      with open(os.path.join(src, DIGEST_FILE)) as f:
        expected = json.load(f)["digest"]
      if digest(workdir) != expected:
        raise ValueError(f"{src}: its weights do not match {DIGEST_FILE}'s digest (an edited "
                         "or partly committed archive); delete it to make the warm start "
                         "again.")
    if os.path.isdir(path):
      shutil.copytree(path, os.path.join(workdir, name))
    elif os.path.exists(path):
      shutil.copy2(path, os.path.join(workdir, name))
  return True
