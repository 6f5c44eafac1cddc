"""Multi-host start-up and the host-side rules every program follows on many processes.

Every program calls `initialize()` first thing (the launchers do, from their absl flags).
It starts `jax.distributed` from, in order: the arguments (the `--coordinator_address`,
`--num_processes`, `--process_id` flags), the environment (`JAX_COORDINATOR_ADDRESS`,
`JAX_NUM_PROCESSES`, `JAX_PROCESS_ID`), or a cluster JAX detects by itself (SLURM with
more than one task, Open MPI); with none of these it does nothing and the program runs
as one process. `JAX_LOCAL_DEVICE_IDS` (read by JAX) picks a process's GPUs.

What the programs do on many processes (one process per host, all of them running the
same Python code in lockstep):
- Meshes span `jax.devices()`, every process's devices; parameters, optimizer state and
  batches are global arrays sharded over them.
- Host-side work (rollouts, tool calls, rewards, alignment, batches) runs on every
  process over the whole batch. It must come out identical everywhere, because the next
  jitted call is collective: the sampler's outputs are read whole by every process
  (`fetch`), keys are functions of (seed, step), and what need not be a function of its
  input (tool replies and sandboxed rewards: a wall-clock limit may strike on one host
  only) is taken from process 0 (`broadcast_object`).
- A host-side batch becomes a global array by `jax.device_put(batch, sharding)` before the
  jitted step (`rl.train_step`): every process passes the same whole batch and keeps the
  rows of its own devices. (jit itself refuses numpy inputs whose sharding spans other
  processes.)
- Files are written by process 0 only (`is_primary`): metrics, config, evaluation
  results, plots, final HF weights, exchange records. Orbax checkpoints are written by
  every process (each its own shards), with process 0 writing the shared files.
"""

import os
import pickle

import jax
import numpy as np
from absl import flags, logging
from jax.experimental import multihost_utils

_COORDINATOR = flags.DEFINE_string(
    "coordinator_address", None, "host:port of process 0 for jax.distributed (multi-host "
    "runs; default: $JAX_COORDINATOR_ADDRESS or the cluster's, else one process).")
_NUM_PROCESSES = flags.DEFINE_integer(
    "num_processes", None, "Processes of a multi-host run (default: $JAX_NUM_PROCESSES or "
    "the cluster's).")
_PROCESS_ID = flags.DEFINE_integer(
    "process_id", None, "This process's index, 0 .. num_processes - 1 (default: "
    "$JAX_PROCESS_ID or the cluster's).")

# Cluster environments that `jax.distributed.initialize()` detects by itself, by the
# variable that says how many processes the job has.
_CLUSTER_SIZE_VARS = ("SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE")


def _env_int(name: str) -> int | None:
  value = os.environ.get(name)
  return None if value in (None, "") else int(value)


def _cluster_size() -> int:
  return max([_env_int(v) or 1 for v in _CLUSTER_SIZE_VARS])


def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None) -> bool:
  """Starts `jax.distributed` when this is a multi-process run; True if it did.

  Call before anything touches a JAX backend. Arguments left None come from the
  environment (see the module docstring); a run with neither arguments, environment
  nor a multi-task cluster is one process, and this returns False. Calling it again
  is a no-op.
  """
  if jax.distributed.is_initialized():
    return True
  coordinator_address = coordinator_address or os.environ.get("JAX_COORDINATOR_ADDRESS")
  num_processes = num_processes if num_processes is not None else _env_int("JAX_NUM_PROCESSES")
  process_id = process_id if process_id is not None else _env_int("JAX_PROCESS_ID")
  given = (coordinator_address, num_processes, process_id)
  if all(x is None for x in given) and _cluster_size() <= 1:
    return False
  if num_processes == 1 and coordinator_address is None:
    return False
  # CPU devices of different processes talk over gloo (XLA's CPU client has no other
  # cross-process collectives); GPU runs use NCCL whatever this says.
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(coordinator_address, num_processes, process_id)
  logging.info("jax.distributed: process %d of %d, %d local of %d devices.",
               jax.process_index(), jax.process_count(), jax.local_device_count(),
               jax.device_count())
  return True


def initialize_from_flags() -> bool:
  """`initialize` with the `--coordinator_address/--num_processes/--process_id` flags."""
  return initialize(_COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value)


def is_primary() -> bool:
  """Whether this process writes the run's shared files (process 0)."""
  return jax.process_index() == 0


def fetch(x) -> np.ndarray:
  """A device array's whole value on this host, whichever processes hold its shards."""
  if not isinstance(x, jax.Array) or x.is_fully_addressable or x.is_fully_replicated:
    return np.asarray(x)
  return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def fetch_tree(tree):
  """`fetch` of every leaf (parameters for an HF export, one leaf at a time)."""
  return jax.tree.map(fetch, tree)


def broadcast_object(obj):
  """Process 0's `obj` (anything picklable) on every process; `obj` itself on one process.

  For host results that may differ by process: tool replies, sandboxed rewards.
  """
  if jax.process_count() == 1:
    return obj
  data = np.frombuffer(pickle.dumps(obj), np.uint8)
  size = int(multihost_utils.broadcast_one_to_all(np.int32(data.size)))
  buf = np.zeros(size, np.uint8)  # Only process 0's contents matter; shapes must agree.
  buf[:min(size, data.size)] = data[:size]
  return pickle.loads(np.asarray(multihost_utils.broadcast_one_to_all(buf), np.uint8).tobytes())
