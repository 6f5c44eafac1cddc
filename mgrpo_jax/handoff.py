"""A policy version handed to the sampler: its per-layer compute-dtype weights, one copy.

The learner keeps float32 masters in the stacked layout; the sampler decodes from one
array per layer in the compute dtype (`models/decode.py`). `Handoff.publish(version)` casts
the training weights into that layout on the training devices (a fresh copy: the next
update donates the training state) and, when the sampler has devices of its own
(`config.rollout_devices`), moves the copy there with one `device_put`: only the cast
weights cross, each shard to its place on the rollout mesh, none gathered on one device
(both meshes are `config.mesh`'s axes: of the same shape, a training shard maps onto a
rollout shard). The copy is asynchronous: the sampler keeps decoding with version v while
v + 1 lands (with k = 1 two versions are alive then, k + 1 at most; `pipeline.Pipeline`
lets v go when no step plays it any more).
"""

import functools
from typing import Any

import flax.struct
import jax
import numpy as np

from mgrpo_jax import sharding
from mgrpo_jax.models import decode


@flax.struct.dataclass
class SamplerWeights:
  """One agent's policy version as the sampler reads it (what `play.make_policies` reads of
  an agent: its model config, its parameters and the mesh it samples under); a pytree of
  the parameters, so `jax.block_until_ready` waits for the copy."""

  params: decode.DecodeParams
  model_config: Any = flax.struct.field(pytree_node=False)
  mesh: jax.sharding.Mesh = flax.struct.field(pytree_node=False)
  version: int = flax.struct.field(pytree_node=False)

  @property
  def nbytes(self) -> int:
    return sum(x.nbytes for x in jax.tree.leaves(self.params))


def split_devices(rollout_devices: int, devices=None) -> tuple[list, list]:
  """(rollout devices, training devices): the first `rollout_devices`, and the rest."""
  devices = list(jax.devices() if devices is None else devices)
  if not 0 < rollout_devices < len(devices):
    raise ValueError(f"config.rollout_devices={rollout_devices} must leave at least one of "
                     f"the {len(devices)} devices for training (0 shares them all).")
  return devices[:rollout_devices], devices[rollout_devices:]


def sampler_shardings(config, params, mesh: jax.sharding.Mesh) -> decode.DecodeParams:
  """The sampler weights' shardings on `mesh` (the stacked parameters' rules, per layer)."""
  return decode.shardings(config, sharding.param_shardings(params, mesh))


def shard_bytes(tree, shardings) -> np.ndarray:
  """Bytes each device of the shardings' mesh holds of `tree` (arrays or shapes)."""
  mesh = jax.tree.leaves(shardings)[0].mesh
  index = {d: i for i, d in enumerate(mesh.devices.flat)}
  out = np.zeros(len(index), np.int64)
  for x, s in zip(jax.tree.leaves(tree), jax.tree.leaves(shardings)):
    size = int(np.prod(s.shard_shape(x.shape))) * np.dtype(x.dtype).itemsize
    for d in s.device_set:
      out[index[d]] += size
  return out


class Handoff:
  """Publishes the agents' current weights as `SamplerWeights`, on `rollout_mesh` if given
  (else where they train: all devices shared)."""

  def __init__(self, agents: dict, rollout_mesh: jax.sharding.Mesh | None = None, *,
               fixed=()):
    # Agents in `fixed` never change (not trained): published once, then reused.
    self._agents, self._mesh, self._fixed, self._kept = agents, rollout_mesh, set(fixed), {}
    self._cast, self._dst = {}, {}
    for name, a in agents.items():
      # The cast lays the copy out as the sampler's rules say on the training mesh, so that
      # with equal mesh shapes the move is shard to shard.
      src = sampler_shardings(a.model_config, a.params, a.mesh)
      self._cast[name] = jax.jit(functools.partial(decode.decode_params, a.model_config),
                                 out_shardings=src)
      if rollout_mesh is not None:
        self._dst[name] = sampler_shardings(a.model_config, a.params, rollout_mesh)

  def publish(self, version: int) -> dict[str, SamplerWeights]:
    """{agent: its weights as of now, for the sampler}; dispatched, not waited for."""
    out = {}
    for name, a in self._agents.items():
      if name in self._kept:
        out[name] = self._kept[name]
        continue
      params = self._cast[name](a.params)  # A new copy (a jit never hands back its input).
      mesh = a.mesh
      if self._mesh is not None:
        params, mesh = jax.device_put(params, self._dst[name]), self._mesh
      out[name] = SamplerWeights(params, a.model_config, mesh, version)
      if name in self._fixed:
        self._kept[name] = out[name]
    return out

  def bytes_per_version(self) -> dict[str, int]:
    """Bytes of each agent's sampler weights: what one version moves (once per device that
    holds a replica of a shard)."""
    return {name: int(sum(np.dtype(x.dtype).itemsize * int(np.prod(x.shape))
                          for x in jax.tree.leaves(jax.eval_shape(self._cast[name], a.params))))
            for name, a in self._agents.items()}
