"""A sweep's warm starts, kept in a folder the user names so that a new machine goes on.

  python -m experiments.hierarchy_ablation.save_warm_start --workdir=/work/sweep/sft-single \
      --archive=/data/hierarchy-warm-starts   # an unfinished warm start, by hand

What a run reads of a finished warm start is small: its final weights (`hf/<agent>`, about
1 MB per agent at the CPU size), and what the sweep reports of it, its `done.json` (config,
commit, wall time) and `metrics.jsonl` (its evaluations). The sweep `save`s those once a warm
start has finished (`--archive`). One still training when its machine must stop (a warm start
took about two hours on 2 cores) is saved by hand with the command above, with the sweep
paused (`kill -STOP`): its `progress.json`, config, metrics and checkpoint (weights and
optimizer state, each step checked against its digests on restore), about 3 times the weights.
Weights are never committed: the archive lives on a persistent disk, or is copied from the
machine that made it.

`restore` puts an archived warm start back into a workdir that holds none of its own, where
`--reuse` then checks its config and commit as for any finished run, or resumes the
unfinished one from its checkpoint. `digest` names the final weights, so that every RL run
records which warm start it started from.
"""

import hashlib
import json
import os
import shutil

# Each led by its marker (the file _timed writes): what a run or the JSON reads of a finished
# warm start, what resumes an unfinished one.
FINISHED = ("done.json", "metrics.jsonl", "config.json", "hf")
UNFINISHED = ("progress.json", "metrics.jsonl", "config.json", "checkpoints")
MARKERS = ("done.json", "progress.json")  # A run's own: _timed writes one or the other.
DIGEST_FILE = "archive.json"
# A warm start larger than this (the GPU size's models) stays in its workdir: the archive is
# for what a fresh machine copies in minutes.
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


def _copy(src: str, dest: str, names) -> None:
  """Copies `names` (files or folders, those that exist) from src to dest, in order."""
  for name in dict.fromkeys(names):
    path = os.path.join(src, name)
    if os.path.isdir(path):
      shutil.copytree(path, os.path.join(dest, name))
    elif os.path.exists(path):
      shutil.copy2(path, os.path.join(dest, name))


def _archived(src: str) -> dict | None:
  """archive.json of an archived warm start, or None."""
  path = os.path.join(src, DIGEST_FILE)
  if not os.path.exists(path):
    return None
  with open(path) as f:
    return json.load(f)


def save(workdir: str, archive: str) -> str | None:
  """Copies a warm start to `archive/<basename(workdir)>`, replacing an older copy whole
  (written beside it, then renamed): a finished one's FINISHED files, an unfinished one's
  UNFINISHED files (pause its process first: a checkpoint being written is not copied
  whole). Returns the final weights' digest ("" for an unfinished one), or None when the
  files exceed MAX_BYTES (nothing is written). Refuses to replace an archived finished
  warm start with other weights: the runs of the sweep began from it."""
  finished = os.path.exists(os.path.join(workdir, "done.json"))
  if not finished and not os.path.exists(os.path.join(workdir, "progress.json")):
    raise FileNotFoundError(f"{workdir}: neither done.json nor progress.json; not a run of "
                            "the sweep.")
  dest = os.path.join(archive, os.path.basename(os.path.normpath(workdir)))
  kept = _archived(dest)
  if kept and kept["finished"]:
    weights = digest(workdir) if finished else ""
    if weights == kept["digest"]:
      return weights  # Already archived.
    raise ValueError(f"{dest} holds another finished warm start (weights {kept['digest'][:12]}"
                     f", this one's {weights[:12] or 'unfinished'}), which the sweep's runs "
                     "began from: delete that folder first to replace it.")
  names = FINISHED if finished else UNFINISHED
  if sum(_size(os.path.join(workdir, n)) for n in names
         if os.path.exists(os.path.join(workdir, n))) > MAX_BYTES:
    return None
  tmp, old = dest + ".tmp", dest + ".old"
  shutil.rmtree(tmp, ignore_errors=True)
  os.makedirs(tmp)
  _copy(workdir, tmp, names)
  weights = digest(tmp) if finished else ""
  with open(os.path.join(tmp, DIGEST_FILE), "w") as f:
    json.dump({"digest": weights, "finished": finished, "from": os.path.abspath(workdir)},
              f, indent=1)
  # The old copy goes only once the new one is in place (restore also reads `.old`).
  shutil.rmtree(old, ignore_errors=True)
  if os.path.exists(dest):
    os.replace(dest, old)
  os.replace(tmp, dest)
  shutil.rmtree(old, ignore_errors=True)
  return weights


def restore(archive: str, workdir: str) -> bool:
  """Copies `archive/<basename(workdir)>` into `workdir` when the workdir holds no run of its
  own (neither done.json nor progress.json); False when there was nothing to restore.
  Raises ValueError, before touching the workdir, when the archive lacks a file it needs,
  and after copying, when a finished warm start's weights are not the archived ones."""
  src = os.path.join(archive, os.path.basename(os.path.normpath(workdir)))
  kept = _archived(src)
  if kept is None and (kept := _archived(src + ".old")) is not None:
    src += ".old"  # A save cut short between its two renames.
  if kept is None:
    return False
  if any(os.path.exists(os.path.join(workdir, n)) for n in MARKERS):
    return False
  finished = kept["finished"]
  names = FINISHED if finished else UNFINISHED
  missing = [n for n in names if not os.path.exists(os.path.join(src, n))]
  if missing:
    raise ValueError(f"{src}: the archive lacks {', '.join(missing)} (partly committed?); "
                     "delete it to make the warm start again.")
  # Without a marker the workdir holds nothing a run made (one always begins with
  # progress.json), e.g. a restore cut short.
  shutil.rmtree(workdir, ignore_errors=True)
  os.makedirs(workdir)
  marker = names[0]
  # The marker last: a restore cut short leaves no run that looks finished or resumable.
  _copy(src, workdir, names[1:])
  if finished and digest(workdir) != kept["digest"]:
    raise ValueError(f"{src}: its weights do not match {DIGEST_FILE}'s digest (an edited or "
                     "partly committed archive); delete it to make the warm start again.")
  shutil.copy2(os.path.join(src, marker), os.path.join(workdir, marker))
  return True

