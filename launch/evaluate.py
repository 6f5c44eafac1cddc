"""Evaluates --workdir's latest checkpoint, the latest pair of a decoupled --run, or the experts.

  python launch/evaluate.py --config=configs/mgrpo.py:runlocal,policy=expert --workdir=/tmp/e
  python launch/evaluate.py --config=configs/mgrpo.py:smoke --workdir=/tmp/e --run=file:///tmp/r1
  python launch/evaluate.py --config=configs/magrpo.py:runlocal --workdir=/tmp/magrpo
  python launch/evaluate.py --workdir=/tmp/mgrpo   # a finished run: its own config.json
"""

import jax
from absl import app, flags, logging
from ml_collections import config_flags

from mgrpo_jax import compile_cache, distributed, evaluate, workdir

_CONFIG = config_flags.DEFINE_config_file("config", None, "Config file[:args]; default: the "
                                          "config.json of the run in --workdir.",
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory; eval.json is written there.")
_RUN = flags.DEFINE_string("run", None, "A decoupled run's location (the role programs' "
                           "--exchange): evaluates the newest step both roles committed.")
flags.mark_flags_as_required(["workdir"])


def main(argv):
  del argv
  logging.set_verbosity(logging.INFO)
  distributed.initialize_from_flags()  # Multi-host runs; a no-op for one process.
  compile_cache.enable_from_flags()  # Restarts and sweeps skip compiling again.
  logging.info("Devices: %s", jax.devices())
  config = _CONFIG.value
  if config is None:
    try:
      config = workdir.load_config(_WORKDIR.value)
    except FileNotFoundError as e:
      raise app.UsageError(str(e)) from None
  result = evaluate.run(config, _WORKDIR.value, run_location=_RUN.value)
  print({k: round(v, 4) if isinstance(v, float) else v for k, v in result.items()})


if __name__ == "__main__":
  app.run(main)
