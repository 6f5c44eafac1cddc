"""Evaluates --workdir's latest checkpoint, the latest pair of a decoupled --run, or the experts.

  python launch/evaluate.py --config=configs/mgrpo.py:runlocal,policy=expert --workdir=/tmp/e
  python launch/evaluate.py --config=configs/mgrpo.py:smoke --workdir=/tmp/e --run=file:///tmp/r1
  python launch/evaluate.py --config=configs/magrpo.py:runlocal --workdir=/tmp/magrpo
  python launch/evaluate.py --workdir=/tmp/mgrpo   # a finished run: its own config.json
"""

from absl import flags
from ml_collections import config_flags

from mgrpo_jax import cli, evaluate, workdir

_CONFIG = config_flags.DEFINE_config_file("config", None, "Config file[:args]; default: the "
                                          "config.json of the run in --workdir.",
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory; eval.json is written there.")
_RUN = flags.DEFINE_string("run", None, "A decoupled run's location (the role programs' "
                           "--exchange): evaluates the newest step both roles committed.")
flags.mark_flags_as_required(["workdir"])


def main(argv):
  del argv
  cli.start()
  config = _CONFIG.value or workdir.load_config(_WORKDIR.value)
  result = evaluate.run(config, _WORKDIR.value, run_location=_RUN.value)
  print({k: round(v, 4) if isinstance(v, float) else v for k, v in result.items()})
  print(f"Evaluation done: accuracy {result['accuracy']:.3f} at step {result['step']}; "
        f"wrote {_WORKDIR.value}/eval.json.")


if __name__ == "__main__":
  cli.run(main)
