"""Reads and writes HF Qwen3 and Qwen3-MoE checkpoint directories (config.json + safetensors).

MoE experts are stored per expert (`mlp.experts.{e}.gate_proj.weight`, as transformers'
`save_pretrained` and the released checkpoints write them) and stacked here on an expert axis.
"""

import dataclasses
import glob
import json
import os
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from mgrpo_jax import sharding
from mgrpo_jax.models import qwen3
from mgrpo_jax.models.config import Qwen3Config
from mgrpo_jax.models.safetensors_io import FLOAT_DTYPES, CheckpointError, SafetensorsFile, write

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
# Buffers some exporters write that carry no parameters.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


@dataclasses.dataclass(frozen=True)
class _Tensor:
  """One of our parameters and the HF tensor(s) it comes from."""

  path: tuple[str, ...]  # Path in the parameter state.
  hf_name: str  # With "{i}" for the layer index when per layer, "{e}" for the expert.
  layers: tuple[int, ...] | None  # HF layer index of each entry of our stacked axis 0.
  to_ours: Callable[[np.ndarray], np.ndarray]
  to_hf: Callable[[np.ndarray], np.ndarray]
  experts: int = 0  # > 0: one HF tensor per expert, stacked on our axis 1.

  @property
  def per_layer(self) -> bool:
    return self.layers is not None

  def names(self):
    """Every HF tensor name of this parameter, in our stacking order."""
    for i in self.layers if self.per_layer else [None]:
      for e in range(self.experts) if self.experts else [None]:
        yield self.hf_name.format(i=i, e=e)


def _tensor_map(cfg: Qwen3Config) -> list[_Tensor]:
  d, h, k, dh = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
  ident = lambda w: w
  t = lambda w: w.T  # torch Linear stores [out, in]; we compute x @ W[in, out].

  def proj_in(n):  # [n*dh, d] <-> [d, n, dh]
    return (lambda w: w.T.reshape(d, n, dh)), (lambda w: w.reshape(d, n * dh).T)

  pre = "model.layers.{i}."
  q_in, q_out = proj_in(h)
  kv_in, kv_out = proj_in(k)
  out = [
      _Tensor(("embed",), "model.embed_tokens.weight", None, ident, ident),
      _Tensor(("final_norm", "scale"), "model.norm.weight", None, ident, ident),
  ]
  sparse = cfg.sparse_layers()
  for stack, ids in (("layers", [i for i, s in enumerate(sparse) if not s]),
                     ("moe_layers", [i for i, s in enumerate(sparse) if s])):
    if not ids:
      continue
    ids = tuple(ids)
    out += [
        _Tensor((stack, "attn", "q"), pre + "self_attn.q_proj.weight", ids, q_in, q_out),
        _Tensor((stack, "attn", "k"), pre + "self_attn.k_proj.weight", ids, kv_in, kv_out),
        _Tensor((stack, "attn", "v"), pre + "self_attn.v_proj.weight", ids, kv_in, kv_out),
        _Tensor((stack, "attn", "o"), pre + "self_attn.o_proj.weight", ids,
                lambda w: w.T.reshape(h, dh, d), lambda w: w.reshape(h * dh, d).T),
        _Tensor((stack, "attn", "q_norm", "scale"), pre + "self_attn.q_norm.weight", ids,
                ident, ident),
        _Tensor((stack, "attn", "k_norm", "scale"), pre + "self_attn.k_norm.weight", ids,
                ident, ident),
        _Tensor((stack, "attn_norm", "scale"), pre + "input_layernorm.weight", ids, ident,
                ident),
        _Tensor((stack, "mlp_norm", "scale"), pre + "post_attention_layernorm.weight", ids,
                ident, ident),
    ]
    if stack == "layers":
      out += [_Tensor((stack, "mlp", n), pre + f"mlp.{n}_proj.weight", ids, t, t)
              for n in ("gate", "up", "down")]
    else:
      out.append(_Tensor((stack, "moe", "router"), pre + "mlp.gate.weight", ids, t, t))
      out += [_Tensor((stack, "moe", n), pre + "mlp.experts.{e}." + f"{n}_proj.weight", ids,
                      t, t, experts=cfg.num_experts) for n in ("gate", "up", "down")]
  if not cfg.tie_embeddings:
    out.append(_Tensor(("lm_head",), "lm_head.weight", None, t, t))
  return out


def _hf_shape(spec: _Tensor, our_shape: tuple[int, ...]) -> tuple[int, ...]:
  shape = our_shape[int(spec.per_layer) + int(spec.experts > 0):]
  return spec.to_hf(np.empty(shape, np.int8)).shape


class _Checkpoint:
  """Name -> file lookup over a single or sharded safetensors checkpoint.

  Only the files the index names (or `model.safetensors` without one) are read, and only
  plain file names inside `path`: a stray *.safetensors beside them overrides nothing.
  """

  def __init__(self, path: str):
    index = os.path.join(path, INDEX_FILE)
    self.files: dict[str, SafetensorsFile] = {}
    self.where: dict[str, str] = {}
    if os.path.exists(index):
      try:
        with open(index) as f:
          weight_map = json.load(f)["weight_map"]
      except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise CheckpointError(f"{index}: not a valid safetensors index ({e}).") from e
      if not isinstance(weight_map, dict) or not all(
          isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()):
        raise CheckpointError(f"{index}: weight_map must map tensor names to file names.")
      for fname in sorted(set(weight_map.values())):
        if os.path.basename(fname) != fname or fname in (".", "..") or os.sep in fname:
          raise CheckpointError(f"{index} names shard {fname!r}, which is not a file name "
                                f"inside {path}.")
        fpath = os.path.join(path, fname)
        if not os.path.exists(fpath):
          raise CheckpointError(f"{index} names shard {fname}, which is missing from {path}.")
        self.files[fname] = SafetensorsFile(fpath)
      for name, fname in weight_map.items():
        if name not in self.files[fname].header:
          raise CheckpointError(f"{index} maps {name!r} to {fname}, which lacks that tensor.")
        self.where[name] = fname
    else:
      others = sorted(os.path.basename(p)
                      for p in glob.glob(os.path.join(path, "*.safetensors")))
      if SINGLE_FILE not in others:
        raise CheckpointError(f"No {SINGLE_FILE} (and no {INDEX_FILE}) in {path}"
                              + (f"; {', '.join(others)} are read only through an index."
                                 if others else "."))
      if others != [SINGLE_FILE]:
        logging.warning("%s: ignoring %s (not named by an index; only %s is read).", path,
                        ", ".join(f for f in others if f != SINGLE_FILE), SINGLE_FILE)
      self.files[SINGLE_FILE] = SafetensorsFile(os.path.join(path, SINGLE_FILE))
      self.where = {name: SINGLE_FILE for name in self.files[SINGLE_FILE].names()}

  def shape(self, name):
    return self.files[self.where[name]].shape(name)

  def read(self, name) -> np.ndarray:
    return self.files[self.where[name]].read(name)

  def dtype(self, name) -> str:
    return self.files[self.where[name]].dtype(name)

  def describe(self, name) -> str:
    return f"{name!r} (in {self.where[name]})"


def _check_names(ckpt: _Checkpoint, specs, cfg: Qwen3Config, abstract: dict, path: str):
  """Raises one error that lists every missing, unexpected or misshapen tensor."""
  expected = {}
  for spec in specs:
    shape = _hf_shape(spec, _get(abstract, spec.path).shape)
    for name in spec.names():
      expected[name] = shape
  present = {n for n in ckpt.where if not n.endswith(_IGNORED_SUFFIXES)}
  if cfg.tie_embeddings:
    present.discard("lm_head.weight")  # Some exporters write the tied head anyway.
  problems = []
  missing = sorted(set(expected) - present)
  unexpected = sorted(present - set(expected))
  if missing:
    problems.append(f"missing {len(missing)} tensor(s): {', '.join(missing[:8])}"
                    + (" ..." if len(missing) > 8 else ""))
  if unexpected:
    problems.append(f"unexpected {len(unexpected)} tensor(s): {', '.join(unexpected[:8])}"
                    + (" ..." if len(unexpected) > 8 else ""))
  for name in sorted(set(expected) & present):
    if ckpt.dtype(name) not in FLOAT_DTYPES:
      problems.append(f"tensor {ckpt.describe(name)} has dtype {ckpt.dtype(name)}, but it is "
                      f"a float weight ({'/'.join(FLOAT_DTYPES)})")
    if tuple(ckpt.shape(name)) != tuple(expected[name]):
      problems.append(f"tensor {ckpt.describe(name)} has shape {tuple(ckpt.shape(name))}, "
                      f"config.json implies {tuple(expected[name])}")
  if problems:
    raise CheckpointError(f"Checkpoint {path} does not match its config.json: "
                          + "; ".join(problems) + ".")


def _get(tree: dict, path):
  for k in path:
    tree = tree[k]
  return tree


def _set(tree: dict, path, value):
  for k in path[:-1]:
    tree = tree.setdefault(k, {})
  tree[path[-1]] = value


def _load_one(ckpt, spec: _Tensor, cfg, shape, dtype, mesh: Mesh | None):
  """One parameter; with a mesh, each device reads only the layers (experts) of its shard."""
  del cfg

  def read(name, rest):
    return np.asarray(spec.to_ours(ckpt.read(name)))[rest]

  def host_slice(index):
    if not spec.per_layer:
      return read(spec.hf_name, index).astype(dtype)
    layers = spec.layers[index[0]]
    if not spec.experts:
      return np.stack([read(spec.hf_name.format(i=i), tuple(index[1:]))
                       for i in layers]).astype(dtype)
    experts = range(spec.experts)[index[1]]
    return np.stack([np.stack([read(spec.hf_name.format(i=i, e=e), tuple(index[2:]))
                               for e in experts]) for i in layers]).astype(dtype)

  if mesh is None:
    return jnp.asarray(host_slice(tuple(slice(None) for _ in shape)))
  path = "/".join(spec.path)
  named = NamedSharding(mesh, sharding.param_spec(path, shape, mesh))
  return jax.make_array_from_callback(shape, named, host_slice)


def load_hf(path: str, *, dtype=jnp.float32, mesh: Mesh | None = None,
            compute_dtype=None) -> tuple[Qwen3Config, nnx.State]:
  """Loads a local HF Qwen3 (or Qwen3-MoE) directory into (config, params).

  Args:
    path: directory with `config.json` and `model.safetensors`, or sharded
      `model-0000X-of-0000N.safetensors` plus `model.safetensors.index.json`.
    dtype: parameter dtype (the checkpoint's dtype is converted).
    mesh: if given, each tensor is placed straight into its shards by the rules in
      `mgrpo_jax.sharding`; no device ever holds a full copy of a sharded tensor.
    compute_dtype: activation dtype; defaults to `dtype`.
  """
  if not os.path.isdir(path):
    raise CheckpointError(f"HF checkpoint directory {path} does not exist.")
  name = jnp.dtype(dtype).name
  cfg = Qwen3Config.from_hf_json(path, param_dtype=name,
                                 compute_dtype=jnp.dtype(compute_dtype or dtype).name)
  ckpt = _Checkpoint(path)
  abstract = nnx.to_pure_dict(qwen3.abstract_params(cfg))
  specs = _tensor_map(cfg)
  _check_names(ckpt, specs, cfg, abstract, path)
  pure = {}
  np_dtype = np.dtype(jnp.dtype(dtype))
  for spec in specs:
    shape = tuple(_get(abstract, spec.path).shape)
    _set(pure, spec.path, _load_one(ckpt, spec, cfg, shape, np_dtype, mesh))
  params = qwen3.abstract_params(cfg)
  nnx.replace_by_pure_dict(params, pure)
  logging.info("Loaded %s: %d layers, %.1fM params.", path, cfg.num_layers,
               cfg.num_params() / 1e6)
  return cfg, params


def save_hf(path: str, config: Qwen3Config, params: nnx.State, *,
            max_shard_bytes: int = 5 * 2**30) -> None:
  """Writes an HF directory that `AutoModelForCausalLM.from_pretrained` loads.

  Tensors keep the parameters' dtype. Shards split at `max_shard_bytes`, with the
  standard index file when there is more than one.
  """
  os.makedirs(path, exist_ok=True)
  # Files of an earlier save with other sharding would shadow this one for some loaders.
  stale = glob.glob(os.path.join(path, "model-*-of-*.safetensors"))
  stale += [os.path.join(path, f) for f in (SINGLE_FILE, INDEX_FILE)]
  for f in stale:
    if os.path.exists(f):
      os.remove(f)
  pure = nnx.to_pure_dict(params)
  tensors = {}
  for spec in _tensor_map(config):
    arr = np.asarray(jax.device_get(_get(pure, spec.path)))
    if spec.per_layer and spec.experts:
      arr = arr.reshape(-1, *arr.shape[2:])  # [L, E, ...] -> [L * E, ...], names' order.
    elif not spec.per_layer:
      arr = arr[None]
    for name, w in zip(spec.names(), arr, strict=True):
      tensors[name] = np.ascontiguousarray(spec.to_hf(w))
  shards, current, size = [], {}, 0
  for name, arr in tensors.items():
    if current and size + arr.nbytes > max_shard_bytes:
      shards.append(current)
      current, size = {}, 0
    current[name] = arr
    size += arr.nbytes
  shards.append(current)
  if len(shards) == 1:
    write(os.path.join(path, SINGLE_FILE), shards[0])
  else:
    weight_map = {}
    for n, shard in enumerate(shards, 1):
      fname = f"model-{n:05d}-of-{len(shards):05d}.safetensors"
      write(os.path.join(path, fname), shard)
      weight_map.update({name: fname for name in shard})
    index = {"metadata": {"total_size": sum(a.nbytes for a in tensors.values())},
             "weight_map": weight_map}
    with open(os.path.join(path, INDEX_FILE), "w") as f:
      json.dump(index, f, indent=2)
  hf = config.to_hf_dict()
  hf["torch_dtype"] = np.dtype(next(iter(tensors.values())).dtype).name
  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump(hf, f, indent=2)
