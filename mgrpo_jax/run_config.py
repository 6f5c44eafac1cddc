"""A workdir owns its config: evaluation reads it back, and a resume may not silently change it.

`config.json` is written when a run starts (`save`). A resume compares the config it was
given with the stored one (`check_resume`): fields that only extend or observe the run
(`EXTENDS_OR_OBSERVES`: more steps, other evaluation and checkpoint intervals) may change;
any other difference is refused naming the fields, unless the user allows it
(`--allow_config_change`), which appends the change to `config_changes.jsonl` beside it.
Either way `config.json` then holds the config the run goes on with.
"""

import datetime
import json
import os

import ml_collections

from mgrpo_jax import distributed

CONFIG_FILE = "config.json"
CHANGES_FILE = "config_changes.jsonl"
# Fields a resume may change freely (an SFT run's own schedule under `sft.` too).
EXTENDS_OR_OBSERVES = ("num_steps", "eval_every", "checkpoint_every", "log_every",
                       "num_eval_questions", "sft.num_steps", "sft.eval_every",
                       "sft.checkpoint_every")  # fmt: skip


class ConfigChangeError(ValueError):
  """A resume was given a config that differs from the run's own."""


def _plain(c) -> dict:
  """The config as JSON values (tuples as lists), as `config.json` holds it."""
  return json.loads(c.to_json_best_effort() if hasattr(c, "to_json_best_effort") else json.dumps(c))


def _flatten(d, prefix: str = "") -> dict:
  out = {}
  for k, v in d.items():
    if isinstance(v, dict) and v:
      out.update(_flatten(v, f"{prefix}{k}."))
    else:
      out[f"{prefix}{k}"] = v
  return out


def differences(stored: dict, current: dict) -> dict[str, tuple]:
  """Dotted field -> (stored value, current value) for every field that differs."""
  a, b = _flatten(stored), _flatten(current)
  missing = object()
  return {k: (a.get(k), b.get(k)) for k in sorted(set(a) | set(b))
          if a.get(k, missing) != b.get(k, missing)}


def load(workdir: str) -> ml_collections.ConfigDict:
  """The config a run in `workdir` was started with (its `config.json`)."""
  path = os.path.join(workdir, CONFIG_FILE)
  if not os.path.exists(path):
    raise FileNotFoundError(f"{path} does not exist: {workdir!r} holds no run's config; "
                            "pass --config.")
  with open(path) as f:
    return ml_collections.ConfigDict(json.load(f))


def save(workdir: str, c) -> None:
  """Writes `c` as the run's config (by process 0)."""
  if not distributed.is_primary():
    return
  os.makedirs(workdir, exist_ok=True)
  with open(os.path.join(workdir, CONFIG_FILE), "w") as f:
    f.write(json.dumps(_plain(c), indent=2))


def check_resume(workdir: str, c, *, allow_change: bool = False) -> dict[str, tuple]:
  """Refuses to go on with a run whose stored config differs from `c` (see module doc).

  A workdir without `config.json` starts fresh: `c` is saved. Returns the differences
  (empty when none). Only process 0 reads and writes the file (others return {}).
  """
  if not distributed.is_primary():
    return {}
  path = os.path.join(workdir, CONFIG_FILE)
  if not os.path.exists(path):
    save(workdir, c)
    return {}
  with open(path) as f:
    changed = differences(json.load(f), _plain(c))
  refused = {k: v for k, v in changed.items() if k not in EXTENDS_OR_OBSERVES}
  if refused and not allow_change:
    lines = "\n".join(f"  {k}: {old!r} -> {new!r}" for k, (old, new) in refused.items())
    raise ConfigChangeError(
        f"{workdir} holds a run with another config; a resume must not change:\n{lines}\n"
        "Pass --allow_config_change to go on with the new values (recorded in "
        f"{os.path.join(workdir, CHANGES_FILE)}), or use a new --workdir.")
  if changed:
    record = {"time": datetime.datetime.now(datetime.timezone.utc).isoformat(),
              "allowed": bool(refused), "fields": {k: list(v) for k, v in changed.items()}}
    with open(os.path.join(workdir, CHANGES_FILE), "a") as f:
      f.write(json.dumps(record) + "\n")
    save(workdir, c)
  return changed
