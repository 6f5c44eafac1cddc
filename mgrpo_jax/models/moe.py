"""Qwen3-MoE's sparse block: float32 router, top-k, grouped expert matmuls, expert parallelism.

Numerics follow transformers' `Qwen3MoeSparseMoeBlock`: softmax over all experts in float32,
the top k kept (renormalised to sum 1 when `norm_topk_prob`), each chosen expert's SwiGLU
output scaled by its weight and summed. The experts run as grouped matmuls
(`jax.lax.ragged_dot`) over the token copies sorted by expert, never a loop over experts.

Expert parallelism: under a mesh with an `expert` axis (set by `jax.set_mesh` /
`use_abstract_mesh`), the expert weights are split over it and the block runs in a
`shard_map`: each device all-gathers the routed tokens of its `expert` group, runs only its
own experts on them, and a reduce-scatter returns each token's sum to the device it came
from. Dropless and fixed-shape (no capacity factor, so no token is ever dropped).
"""

import math

import flax.struct
import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from mgrpo_jax import sharding
from mgrpo_jax.models.config import Qwen3Config


@flax.struct.dataclass
class Routed:
  """What a sparse layer chose, and the sums its load-balancing loss needs."""

  experts_BxTxK: jax.Array  # int32 expert ids per token (for routing replay)
  counts_E: jax.Array  # float32: weighted number of top-k assignments per expert
  probs_E: jax.Array  # float32: weighted sum of router probabilities per expert
  rows: jax.Array  # float32: weighted number of tokens


def route_dtype(num_experts: int):
  """The integer type recorded expert ids are kept in: uint8 for up to 256 experts."""
  return jnp.uint8 if num_experts <= 256 else jnp.int16


def route(x_NxD, router_DxE, k: int, norm_topk_prob: bool, experts_NxK=None):
  """(probabilities [N, E] float32, expert ids [N, K], weights [N, K] float32).

  With `experts_NxK` (routing replay) those experts are used; their weights still come from
  this router's probabilities, so the router keeps its gradient.
  """
  logits = jnp.einsum("nd,de->ne", x_NxD, router_DxE.astype(x_NxD.dtype),
                      preferred_element_type=jnp.float32)
  probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
  if experts_NxK is None:
    weights, experts_NxK = jax.lax.top_k(probs, k)
  else:
    experts_NxK = experts_NxK.astype(jnp.int32)
    weights = jnp.take_along_axis(probs, experts_NxK, axis=-1)
  if norm_topk_prob:
    weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
  return probs, experts_NxK.astype(jnp.int32), weights


def _local_experts(x_NxD, experts_NxK, weights_NxK, gate_ExDxF, up_ExDxF, down_ExFxD, first):
  """Sum over a token's chosen experts that lie in [first, first + E_local), else 0.

  The N * K token copies are sorted by local expert (copies for other devices' experts go
  last, outside every group), run through ragged_dot, and unsorted by the inverse
  permutation (a gather, deterministic: no scatter-add of float partial sums).
  """
  n, k = experts_NxK.shape
  e_local = gate_ExDxF.shape[0]
  local = experts_NxK.reshape(-1) - first
  mine = (local >= 0) & (local < e_local)
  key = jnp.where(mine, local, e_local)
  order = jnp.argsort(key, stable=True)
  sizes = jnp.zeros((e_local,), jnp.int32).at[key].add(1, mode="drop")
  x_sorted = jnp.take(x_NxD, order // k, axis=0)
  dt = x_NxD.dtype
  g = jax.lax.ragged_dot(x_sorted, gate_ExDxF.astype(dt), sizes)
  u = jax.lax.ragged_dot(x_sorted, up_ExDxF.astype(dt), sizes)
  y_sorted = jax.lax.ragged_dot(jax.nn.silu(g) * u, down_ExFxD.astype(dt), sizes)
  # Rows past the last group are not written by every ragged_dot kernel: mask them.
  y_sorted = jnp.where(jnp.take(mine, order)[:, None], y_sorted, 0)
  y = jnp.take(y_sorted, jnp.argsort(order), axis=0).reshape(n, k, -1)
  w = jnp.where(mine.reshape(n, k), weights_NxK, 0).astype(dt)
  return jnp.einsum("nkd,nk->nd", y, w)


def _in_chunks(fn, chunk: int, *args_N):
  """fn over rows in chunks of `chunk` (a rematerialised scan), or at once when 0/larger."""
  n = args_N[0].shape[0]
  if not chunk or n <= chunk:
    return fn(*args_N)
  pad = -n % chunk
  padded = [jnp.pad(a, [(0, pad)] + [(0, 0)] * (a.ndim - 1)) for a in args_N]
  stacked = [a.reshape(-1, chunk, *a.shape[1:]) for a in padded]
  # Checkpointed: the backward pass keeps one chunk's dispatch buffers, not all of them.
  body = jax.checkpoint(lambda _, xs: (None, fn(*xs)), prevent_cse=False)
  _, out = jax.lax.scan(body, None, stacked)
  return out.reshape(-1, *out.shape[2:])[:n]


def _expert_specs(mesh, e: int, d: int, f: int):
  # The specs the parameters really have (sharding.PARAM_RULES, axes that do not divide
  # dropped), without the stacked layer axis.
  gate = sharding.param_spec("moe_layers/moe/gate", (1, e, d, f), mesh)[1:]
  down = sharding.param_spec("moe_layers/moe/down", (1, e, f, d), mesh)[1:]
  return P(*gate), P(*down)


def experts(x_NxD, experts_NxK, weights_NxK, gate_ExDxF, up_ExDxF, down_ExFxD, *,
            chunk: int = 0):
  """Each token's weighted sum over its experts' SwiGLU outputs: [N, D] in x's dtype.

  Without a mesh in context every expert is local. With one, see the module docstring;
  `chunk` bounds the tokens per device dispatched at a time.
  """
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or "expert" not in mesh.axis_names:
    return _in_chunks(lambda x, e, w: _local_experts(x, e, w, gate_ExDxF, up_ExDxF,
                                                     down_ExFxD, 0),
                      chunk, x_NxD, experts_NxK, weights_NxK)
  n = x_NxD.shape[0]
  num_e, d, f = gate_ExDxF.shape
  gate_spec, down_spec = _expert_specs(mesh, num_e, d, f)
  batch = tuple(a for a in sharding.BATCH if a in mesh.axis_names)
  rows = batch if n % math.prod(mesh.shape[a] for a in batch) == 0 else None
  split_experts = gate_spec[0] == "expert"
  gather_rows = split_experts and rows is not None and "expert" in rows
  row_spec = P(rows, None)

  def per_device(x, e, w, gate, up, down):
    # FSDP: gather this layer's expert weights over fsdp (their D axis).
    if gate_spec[1] is not None:
      gate = jax.lax.all_gather(gate, gate_spec[1], axis=1, tiled=True)
      up = jax.lax.all_gather(up, gate_spec[1], axis=1, tiled=True)
    if down_spec[2] is not None:
      down = jax.lax.all_gather(down, down_spec[2], axis=2, tiled=True)
    first = jax.lax.axis_index("expert") * gate.shape[0] if split_experts else 0

    def one(x, e, w):
      if gather_rows:  # Every device of the expert group sees the group's tokens...
        x, e, w = (jax.lax.all_gather(a, "expert", axis=0, tiled=True) for a in (x, e, w))
      y = _local_experts(x, e, w, gate, up, down, first)
      if gate_spec[2] is not None:  # Expert width split over tensor: partial sums.
        y = jax.lax.psum(y, gate_spec[2])
      if gather_rows:  # ...and each gets back the sums over all experts of its own tokens.
        return jax.lax.psum_scatter(y, "expert", scatter_dimension=0, tiled=True)
      return jax.lax.psum(y, "expert") if split_experts else y

    return _in_chunks(one, chunk, x, e, w)

  fn = jax.shard_map(per_device, mesh=mesh,
                     in_specs=(row_spec, row_spec, row_spec, gate_spec, gate_spec, down_spec),
                     out_specs=row_spec, check_vma=False)
  return fn(x_NxD, experts_NxK, weights_NxK, gate_ExDxF, up_ExDxF, down_ExFxD)


class MoE(nnx.Module):
  """The sparse block: router [D, E] and experts gate/up [E, D, F], down [E, F, D]."""

  def __init__(self, cfg: Qwen3Config, *, rngs: nnx.Rngs):
    d, e, f = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
    pd, init = cfg.param_jnp_dtype, nnx.initializers.normal(stddev=0.02)
    self.cfg = cfg
    self.router = nnx.Param(init(rngs.params(), (d, e), pd))
    self.gate = nnx.Param(init(rngs.params(), (e, d, f), pd))
    self.up = nnx.Param(init(rngs.params(), (e, d, f), pd))
    self.down = nnx.Param(init(rngs.params(), (e, f, d), pd))

  def __call__(self, x_BxTxD, token_w_BxT, experts_BxTxK=None):
    """(output [B, T, D], Routed). `experts_BxTxK` replays given routes."""
    cfg = self.cfg
    b, t, d = x_BxTxD.shape
    x = x_BxTxD.reshape(b * t, d)
    given = None if experts_BxTxK is None else experts_BxTxK.reshape(b * t, -1)
    probs, chosen, weights = route(x, self.router[...], cfg.num_experts_per_tok,
                                   cfg.norm_topk_prob, given)
    y = experts(x, chosen, weights, self.gate[...], self.up[...], self.down[...],
                chunk=cfg.moe_chunk)
    w = token_w_BxT.reshape(-1).astype(jnp.float32)
    counts = jnp.zeros((cfg.num_experts,), jnp.float32).at[chosen].add(
        jnp.broadcast_to(w[:, None], chosen.shape))
    routed = Routed(chosen.reshape(b, t, -1), counts, jnp.einsum("ne,n->e", probs, w),
                    jnp.sum(w))
    return y.reshape(b, t, d), routed


def load_balancing_loss(counts_LxE, probs_LxE, rows_L):
  """transformers' `load_balancing_loss_func` from per-layer sums (pooled over layers):
  E * sum_e (assignments_e / rows) * (probability mass_e / rows)."""
  rows = jnp.maximum(jnp.sum(rows_L), 1e-9)
  num_e = counts_LxE.shape[-1]
  return num_e * jnp.sum((jnp.sum(counts_LxE, 0) / rows) * (jnp.sum(probs_LxE, 0) / rows))
