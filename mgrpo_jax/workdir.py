"""What a run keeps in its workdir: its config, its checkpoints restored, its final HF weights.

A workdir owns its config: `config.json` is written when a run starts, evaluation reads it
back (`load_config`), and a resume may not silently change it (`check_resume`): fields that
only extend or observe the run (`EXTENDS_OR_OBSERVES`: more steps, other evaluation and
checkpoint intervals, the metric sinks) may change; any other difference is refused naming the fields, unless
the user allows it (`--allow_config_change`), which appends the change to
`config_changes.jsonl` beside it. Either way `config.json` then holds the config the run
goes on with.
"""

import datetime
import json
import os

import ml_collections
from absl import logging

from mgrpo_jax import checkpoint as ckpt_lib
from mgrpo_jax import distributed
from mgrpo_jax import models, tokenizer_io
from mgrpo_jax import tokenizer as tk
from mgrpo_jax.models import lora

WORDS_FILE = "byte_tokenizer_words.json"  # Beside a saved model trained with ByteTokenizer words.


def restore_agents(ckpt: ckpt_lib.Checkpointer, agents: dict) -> int:
  """Loads the latest checkpoint into `agents` (in place); returns its step, 0 if none."""
  if ckpt.latest_step() is None:
    return 0
  states, meta = ckpt.restore(abstract_states={n: a.state for n, a in agents.items()})
  for n, a in agents.items():
    a.state = states[n]
  logging.info("Restored %s at step %d.", ckpt.directory, int(meta["step"]))
  return int(meta["step"])


def save_final_hf(workdir: str, agents: dict, tokenizer: tk.Tokenizer | None = None) -> None:
  """Final weights as HF checkpoints under workdir/hf/<agent> (an `init=` for later runs),
  with the run's HF tokenizer files, so an export loads with AutoTokenizer as it is.

  A LoRA agent's checkpoint has its adapters merged in, and the adapters alone go to
  workdir/lora/<agent> as a PEFT directory for its base (`Agent.base_path`). Every process
  takes part in gathering the weights; process 0 writes them.
  """
  for name, agent in agents.items():
    path = os.path.join(workdir, "hf", name)
    cfg = agent.model_config
    if agent.frozen is None:
      params = distributed.fetch_tree(agent.state.params)
    else:
      params = lora.merged_params(cfg, distributed.fetch_tree(agent.params))  # On the host.
      adapters = distributed.fetch_tree(agent.state.params)
    if not distributed.is_primary():
      continue
    if agent.frozen is None:
      models.save_hf(path, cfg, params)
    else:
      models.save_hf(path, lora.base_config(cfg), params)
      lora.save_peft(os.path.join(workdir, "lora", name), cfg, adapters,
                     base_model=agent.base_path)
    if tokenizer is not None:  # An HF tokenizer's files: the export loads with AutoTokenizer.
      tokenizer_io.save_tokenizer(tokenizer, path)
    if getattr(tokenizer, "words", ()):
      with open(os.path.join(path, WORDS_FILE), "w") as f:
        json.dump({"words": list(tokenizer.words)}, f)


# ------------------------------------------------------------------ the run's config

CONFIG_FILE = "config.json"
CHANGES_FILE = "config_changes.jsonl"
# Fields a resume may change freely (an SFT run's own schedule under `sft.` too).
EXTENDS_OR_OBSERVES = ("num_steps", "eval_every", "checkpoint_every", "log_every",
                       "num_eval_questions", "sft.num_steps", "sft.eval_every",
                       "sft.checkpoint_every", "log_to", "wandb.project", "wandb.name",
                       "wandb.entity", "tools.outage_s", "tools.max_error_rate")  # fmt: skip


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


# Fields added to the configs after runs were made, with the value that keeps an older run's
# behaviour: a config.json without one is read as holding that value (`differences`).
ADDED_FIELDS = {"rl_worlds": 0, "rl_hop_weights": [], "sft.trace_worlds": -1,
                "log_to": "jsonl,tensorboard", "wandb.project": "mgrpo_jax", "wandb.name": "",
                "wandb.entity": "", "protocol": "tags", "tools.outage_s": 300.0,
                "tools.max_error_rate": 0.5, "data.skip_invalid": False,
                "staleness_tis_cap": 2.0, "rollout_devices": 0, "sampling.slots": 0,
                "eval_sampling.slots": 0, "sampling.share_prompts": False,
                "eval_sampling.share_prompts": False}


def differences(stored: dict, current: dict) -> dict[str, tuple]:
  """Dotted field -> (stored value, current value) for every field that differs; a field of
  `ADDED_FIELDS` absent on one side differs only from a value other than its default."""
  a, b = _flatten(stored), _flatten(current)
  for k, default in ADDED_FIELDS.items():
    if (k in a) != (k in b):
      a.setdefault(k, default)
      b.setdefault(k, default)
  missing = object()
  return {k: (a.get(k), b.get(k)) for k in sorted(set(a) | set(b))
          if a.get(k, missing) != b.get(k, missing)}


def load_config(workdir: str) -> ml_collections.ConfigDict:
  """The config a run in `workdir` was started with (its `config.json`)."""
  path = os.path.join(workdir, CONFIG_FILE)
  if not os.path.exists(path):
    raise FileNotFoundError(f"{path} does not exist: {workdir!r} holds no run's config; "
                            "pass --config.")
  with open(path) as f:
    stored = json.load(f)
  # A run made before a field was added holds the value that keeps its behaviour. M-GRPO's
  # and SFT's configs (with `limits`) have them all; MAGRPO's the logging ones.
  for k, default in ADDED_FIELDS.items():
    if "limits" in stored or k == "log_to" or k.startswith("wandb."):
      *groups, leaf = k.split(".")
      node = stored
      for g in groups:
        node = node.setdefault(g, {})
      node.setdefault(leaf, default)
  return ml_collections.ConfigDict(stored)


def write_config(workdir: str, c) -> None:
  """Writes `c` as the run's config (by process 0)."""
  if not distributed.is_primary():
    return
  os.makedirs(workdir, exist_ok=True)
  with open(os.path.join(workdir, CONFIG_FILE), "w") as f:
    f.write(json.dumps(_plain(c), indent=2))


def check_resume(workdir: str, c, *, allow_change: bool = False) -> dict[str, tuple]:
  """Refuses to go on with a run whose stored config differs from `c` (see module doc).

  A workdir without `config.json` starts fresh (the program writes `c` there once its
  start-up checks have passed: a refused start leaves nothing behind). Returns the
  differences (empty when none). Only process 0 reads and writes the file (others: {}).
  """
  if not distributed.is_primary():
    return {}
  path = os.path.join(workdir, CONFIG_FILE)
  if not os.path.exists(path):
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
    write_config(workdir, c)
  return changed
