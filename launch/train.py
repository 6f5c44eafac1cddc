"""Trains from a config: M-GRPO and its ablations, the SFT warm start, or MAGRPO.

  python launch/train.py --config=configs/mgrpo.py:runlocal --workdir=/tmp/mgrpo
  python launch/train.py --config=configs/magrpo.py:runlocal --workdir=/tmp/magrpo

A workdir owns its config: resuming it with another config is refused, naming the fields,
except num_steps and the evaluation/checkpoint/log intervals, unless --allow_config_change.
"""

from absl import app, flags
from ml_collections import config_flags

from mgrpo_jax import cli, config_checks, workdir
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
  cli.start()
  config = _CONFIG.value
  if config.program not in PROGRAMS:
    raise app.UsageError(f"config.program={config.program!r}; expected one of {list(PROGRAMS)}.")
  config_checks.check_log_to(config)
  config_checks.check_protocol(config)
  workdir.check_resume(_WORKDIR.value, config, allow_change=_ALLOW_CHANGE.value)
  PROGRAMS[config.program](config, _WORKDIR.value)


if __name__ == "__main__":
  cli.run(main)
