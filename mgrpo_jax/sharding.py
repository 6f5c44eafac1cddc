"""Sharding as data: a mesh from config, and partition specs for params, activations, cache.

Mesh axes are `data` (pure data parallel), `fsdp` (data parallel with parameters and
optimizer state sharded), `tensor` (Megatron-style: heads and MLP width split) and `expert`
(mixture-of-experts: the experts split; outside the MoE blocks it is one more data axis, so
attention and the dense weights see it as data parallel).
"""

import re
from typing import Mapping, Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

MESH_AXES = ("data", "fsdp", "tensor", "expert")
BATCH = ("data", "fsdp", "expert")  # The batch axis of activations is split over these.


class ShardingError(ValueError):
  """A mesh or sharding request that cannot be satisfied."""


def mesh_shape(axes: Mapping[str, int] | Sequence[int], num_devices: int) -> tuple[int, ...]:
  """Resolves the sizes of (data, fsdp, tensor, expert); one size may be -1 (= the rest).

  A sequence of three sizes leaves out `expert` (size 1).
  """
  if isinstance(axes, Mapping):
    unknown = set(axes) - set(MESH_AXES)
    if unknown:
      raise ShardingError(f"Unknown mesh axis name(s) {sorted(unknown)}; use {MESH_AXES}.")
    sizes = [int(axes.get(a, 1)) for a in MESH_AXES]
  else:
    sizes = [int(s) for s in axes]
    if len(sizes) == len(MESH_AXES) - 1:
      sizes.append(1)
    if len(sizes) != len(MESH_AXES):
      raise ShardingError(f"Mesh needs {len(MESH_AXES) - 1} or {len(MESH_AXES)} sizes "
                          f"{MESH_AXES}, got {sizes}.")
  if sizes.count(-1) > 1:
    raise ShardingError(f"At most one mesh axis may be -1, got {dict(zip(MESH_AXES, sizes))}.")
  if any(s == 0 or s < -1 for s in sizes):
    raise ShardingError(f"Mesh sizes must be positive or -1, got {dict(zip(MESH_AXES, sizes))}.")
  known = int(np.prod([s for s in sizes if s != -1]))
  if -1 in sizes:
    if num_devices % known:
      raise ShardingError(f"Cannot fill mesh {dict(zip(MESH_AXES, sizes))}: {num_devices} "
                          f"devices are not a multiple of {known}.")
    sizes[sizes.index(-1)] = num_devices // known
  if int(np.prod(sizes)) != num_devices:
    raise ShardingError(f"Mesh {dict(zip(MESH_AXES, sizes))} needs {int(np.prod(sizes))} "
                        f"devices, but {num_devices} are available.")
  return tuple(sizes)


def make_mesh(axes: Mapping[str, int] | Sequence[int] = (-1, 1, 1), devices=None) -> Mesh:
  """A `Mesh` over `devices` (default: all) with axes (data, fsdp, tensor, expert)."""
  devices = list(jax.devices() if devices is None else devices)
  shape = mesh_shape(axes, len(devices))
  return Mesh(np.asarray(devices).reshape(shape), MESH_AXES)


# (regex on the '/'-joined parameter path, spec of the parameter's axes). Stacked
# layer params carry a leading layer axis, which is never sharded.
PARAM_RULES: tuple[tuple[str, tuple], ...] = (
    (r"^embed$", ("tensor", "fsdp")),                       # [V, D]
    (r"^lm_head$", ("fsdp", "tensor")),                     # [D, V]
    (r"layers/attn/(q|k|v)$", (None, "fsdp", "tensor", None)),  # [L, D, N, H]
    (r"layers/attn/o$", (None, "tensor", None, "fsdp")),    # [L, N, H, D]
    (r"layers/mlp/(gate|up)$", (None, "fsdp", "tensor")),   # [L, D, F]
    (r"layers/mlp/down$", (None, "tensor", "fsdp")),        # [L, F, D]
    (r"moe_layers/moe/router$", None),                      # [L, D, E]: small, replicated
    (r"moe_layers/moe/(gate|up)$", (None, "expert", "fsdp", "tensor")),  # [L, E, D, F]
    (r"moe_layers/moe/down$", (None, "expert", "tensor", "fsdp")),       # [L, E, F, D]
    (r"scale$", None),                                      # norms: replicated
    (r"_lora_(a|b)$", None),                                # LoRA factors: small, replicated
)


def _fit(spec: Sequence, shape: Sequence[int], mesh: Mesh) -> P:
  """Drops mesh axes that do not divide their dimension (e.g. 2 kv heads on tensor=4)."""
  out = []
  for dim, axis in zip(shape, spec):
    size = 1 if axis is None else int(np.prod([mesh.shape[a] for a in np.atleast_1d(axis)]))
    out.append(axis if dim % size == 0 else None)
  return P(*out)


def param_spec(path: str, shape: Sequence[int], mesh: Mesh) -> P:
  """The partition spec of one parameter, by its path (e.g. 'layers/attn/q')."""
  for pattern, spec in PARAM_RULES:
    if re.search(pattern, path):
      return P() if spec is None else _fit(spec, shape, mesh)
  raise ShardingError(f"No sharding rule matches parameter {path!r}; add one to PARAM_RULES.")


def path_str(path) -> str:
  keys = [getattr(k, "key", getattr(k, "name", getattr(k, "idx", k))) for k in path]
  return "/".join(str(k) for k in keys if str(k) != "value")


def param_shardings(abstract_params: nnx.State, mesh: Mesh):
  """A pytree of `NamedSharding` matching `abstract_params` (arrays or ShapeDtypeStructs)."""
  def one(path, leaf):
    return NamedSharding(mesh, param_spec(path_str(path), leaf.shape, mesh))
  return jax.tree_util.tree_map_with_path(one, abstract_params)


def batch_sharding(mesh: Mesh, ndim: int = 2) -> NamedSharding:
  """Activations and token batches: leading axis over (data, fsdp)."""
  return NamedSharding(mesh, P(BATCH, *([None] * (ndim - 1))))


def cache_sharding(mesh: Mesh, num_kv_heads: int) -> NamedSharding:
  """KV cache [L, B, K, S, H]: batch over (data, fsdp), kv heads over tensor if they divide."""
  heads = "tensor" if num_kv_heads % mesh.shape["tensor"] == 0 else None
  return NamedSharding(mesh, P(None, BATCH, heads, None, None))
