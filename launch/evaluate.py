"""Evaluates the latest checkpoint in --workdir (or the config's models, or the experts).

  python launch/evaluate.py --config=configs/mgrpo.py:runlocal,policy=expert --workdir=/tmp/e
"""

import jax
from absl import app, flags, logging
from ml_collections import config_flags

from mgrpo_jax import evaluate

_CONFIG = config_flags.DEFINE_config_file("config", None, "Config file[:args].",
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory; eval.json is written there.")
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
  del argv
  logging.set_verbosity(logging.INFO)
  logging.info("Devices: %s", jax.devices())
  result = evaluate.run(_CONFIG.value, _WORKDIR.value)
  print({k: round(v, 4) for k, v in result.items()})


if __name__ == "__main__":
  app.run(main)
