"""The sub agent's program of a decoupled M-GRPO run (shares only --exchange with its peer).

  python launch/main_agent.py --config=configs/mgrpo.py:smoke --workdir=/tmp/m \
      --exchange=file:///tmp/r1 &
  python launch/sub_agent.py --config=configs/mgrpo.py:smoke --workdir=/tmp/s \
      --exchange=file:///tmp/r1

--exchange is the run location both programs share: the exchange under <run>/exchange,
each role's checkpoints under <run>/<role>/checkpoints.
"""

from absl import flags
from ml_collections import config_flags

from mgrpo_jax import cli, config_checks, workdir
from mgrpo_jax.mgrpo import decoupled

_CONFIG = config_flags.DEFINE_config_file("config", None, "Config file[:args].",
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "This program's own directory: metrics, "
                                "final HF weights, cache of s3:// checkpoints.")
_EXCHANGE = flags.DEFINE_string("exchange", None, "Run location shared with the peer (exchange "
                                "and checkpoints): tensorstore kvstore URL or JSON spec.")
_TIMEOUT = flags.DEFINE_float("timeout_s", 600.0, "How long to wait for the peer.")
_ALLOW_CHANGE = flags.DEFINE_bool("allow_config_change", False, "Resume with a config that "
                                   "differs from the run's own (recorded in the workdir).")
flags.mark_flags_as_required(["config", "workdir", "exchange"])


def main(argv):
  del argv
  cli.start()
  config_checks.check_log_to(_CONFIG.value)
  config_checks.check_protocol(_CONFIG.value)
  workdir.check_resume(_WORKDIR.value, _CONFIG.value, allow_change=_ALLOW_CHANGE.value)
  decoupled.run_sub_agent(_CONFIG.value, _WORKDIR.value, _EXCHANGE.value,
                          timeout_s=_TIMEOUT.value)


if __name__ == "__main__":
  cli.run(main)
