"""What a run keeps in its workdir: its config, its checkpoints restored, its final HF weights."""

import json
import os

import ml_collections
from absl import logging

from mgrpo_jax import checkpoint as ckpt_lib
from mgrpo_jax import distributed
from mgrpo_jax import models
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


def write_config(workdir: str, c: ml_collections.ConfigDict) -> None:
  """The run's config beside its metrics (written when a run starts fresh; by process 0)."""
  if not distributed.is_primary():
    return
  with open(os.path.join(workdir, "config.json"), "w") as f:
    f.write(c.to_json_best_effort(indent=2))


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
      tk.save_tokenizer(tokenizer, path)
    if getattr(tokenizer, "words", ()):
      with open(os.path.join(path, WORDS_FILE), "w") as f:
        json.dump({"words": list(tokenizer.words)}, f)
