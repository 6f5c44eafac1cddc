"""Trains from a config: M-GRPO and its ablations, the SFT warm start, or MAGRPO.

  python launch/train.py --config=configs/mgrpo.py:runlocal --workdir=/tmp/mgrpo
  python launch/train.py --config=configs/magrpo.py:runlocal --workdir=/tmp/magrpo

A workdir owns its config: resuming it with another config is refused, naming the fields,
except num_steps and the evaluation/checkpoint/log intervals, unless --allow_config_change.
"""

import jax
from absl import app, flags, logging
from ml_collections import config_flags

from mgrpo_jax import compile_cache, distributed, workdir
from mgrpo_jax.mgrpo import colocated, sft
from mgrpo_jax.magrpo import program as magrpo_program

_CONFIG = config_flags.DEFINE_config_file("config", None, "Config file[:args].",
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory (resumed if it holds a run).")
_ALLOW_CHANGE = flags.DEFINE_bool("allow_config_change", False, "Resume a run with a config "
                                   "that differs from its own (recorded in the workdir).")
flags.mark_flags_as_required(["config", "workdir"])

PROGRAMS = {"mgrpo": colocated.train_and_evaluate, "sft": sft.train_sft,
            "magrpo": magrpo_program.train_and_evaluate}


def main(argv):
  del argv
  logging.set_verbosity(logging.INFO)
  distributed.initialize_from_flags()  # Multi-host runs; a no-op for one process.
  compile_cache.enable_from_flags()  # Restarts and sweeps skip compiling again.
  logging.info("Devices: %s", jax.devices())
  config = _CONFIG.value
  if config.program not in PROGRAMS:
    raise app.UsageError(f"config.program={config.program!r}; expected one of {list(PROGRAMS)}.")
  try:
    workdir.check_resume(_WORKDIR.value, config, allow_change=_ALLOW_CHANGE.value)
  except workdir.ConfigChangeError as e:
    raise app.UsageError(str(e)) from None
  PROGRAMS[config.program](config, _WORKDIR.value)


if __name__ == "__main__":
  app.run(main)
