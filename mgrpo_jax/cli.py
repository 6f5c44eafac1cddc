"""What every launcher shares: start-up, short messages for user errors, a clean failed start.

  def main(argv):
    cli.start()
    ...
  if __name__ == "__main__":
    cli.run(main)

`run` turns the project's own errors (a config value, a checkpoint, a dataset, the exchange
or its lease, a path that does not exist) into one line on stderr and exit status 1; with
`--verbose` they keep their traceback, as every other exception does. A program that fails
before writing its first step removes the directories this invocation created for
`--workdir` (never a directory that existed before it started).
"""

import os
import shutil
import sys

import jax
from absl import app, flags, logging

from mgrpo_jax import compile_cache, distributed, exchange
from mgrpo_jax import checkpoint as ckpt_lib
from mgrpo_jax import config_checks, metrics, plotting, sharding
from mgrpo_jax import workdir as workdir_lib
from mgrpo_jax.agents import continuation
from mgrpo_jax.envs import datasets, tool_health
from mgrpo_jax.magrpo import rollout
from mgrpo_jax.models import config as model_config
from mgrpo_jax.models import safetensors_io

_VERBOSE = flags.DEFINE_boolean("verbose", False, "Show the traceback of a user error "
                                "(a bad config value, checkpoint, dataset or exchange).")

# Errors whose message tells the user what to change: printed alone, without a traceback.
USER_ERRORS = (config_checks.ConfigValueError, model_config.ConfigError,
               safetensors_io.CheckpointError, ckpt_lib.CorruptCheckpointError,
               datasets.DatasetError, exchange.ExchangeError, sharding.ShardingError,
               continuation.TemplateError, rollout.PromptTooLongError, plotting.UnknownMetricError,
               workdir_lib.ConfigChangeError, FileNotFoundError, NotADirectoryError,
               FileExistsError, app.UsageError, tool_health.ToolOutage)


def start(devices: bool = True):
  """INFO logs; multi-host set-up and the compilation cache; the devices, logged."""
  logging.set_verbosity(logging.INFO)
  distributed.initialize_from_flags()  # Multi-host runs; a no-op for one process.
  compile_cache.enable_from_flags()  # Restarts and sweeps skip compiling again.
  if devices:
    logging.info("Devices: %s", jax.devices())


def check_workdir(path: str | None, flag: str = "workdir"):
  """Refuses a --workdir that is a file, or lies below one, before anything is written."""
  if not path:
    return
  probe = os.path.abspath(path)
  while probe and not os.path.exists(probe):
    probe = os.path.dirname(probe)
  if probe and not os.path.isdir(probe):
    which = "is a file" if probe == os.path.abspath(path) else f"lies below the file {probe}"
    raise NotADirectoryError(f"--{flag}={path} {which}; give a directory (new or a run's).")


def _first_missing(path: str) -> str | None:
  """The outermost directory of `path` that does not exist yet (what makedirs would create)."""
  path, missing = os.path.abspath(path), None
  while not os.path.exists(path):
    missing, path = path, os.path.dirname(path)
  return missing


def _has_steps(root: str) -> bool:
  """Whether a program wrote a step (a metrics record) anywhere under `root`."""
  for folder, _, files in os.walk(root):
    if metrics.METRICS_FILE in files:
      if os.path.getsize(os.path.join(folder, metrics.METRICS_FILE)) > 0:
        return True
  return False


def _message(e: BaseException) -> str:
  if isinstance(e, (FileNotFoundError, NotADirectoryError, FileExistsError)) and e.filename:
    return f"{e.strerror or type(e).__name__}: {e.filename}"
  return f"{type(e).__name__}: {e}" if not isinstance(e, app.UsageError) else str(e)


def guarded(main, argv, workdir_flag: str = "workdir"):
  """Runs `main(argv)`: user errors as one line and exit 1, a failed start cleaned up."""
  workdir = flags.FLAGS[workdir_flag].value if workdir_flag in flags.FLAGS else None
  created = None
  try:
    check_workdir(workdir, workdir_flag)
    created = _first_missing(workdir) if workdir else None
    return main(argv)
  except (Exception, KeyboardInterrupt) as e:
    if created and os.path.isdir(created) and not _has_steps(created):
      shutil.rmtree(created, ignore_errors=True)
      logging.info("Removed %s: this run failed before its first step.", created)
    if _VERBOSE.value or not isinstance(e, USER_ERRORS):
      raise
    name = os.path.basename(sys.argv[0]) if sys.argv else "mgrpo_jax"
    print(f"{name}: error: {_message(e)}\n(--verbose shows the traceback)", file=sys.stderr)
    sys.exit(1)


def run(main, workdir_flag: str = "workdir"):
  """`app.run(main)`, with `guarded`'s short messages and clean-up."""
  app.run(lambda argv: guarded(main, argv, workdir_flag))
