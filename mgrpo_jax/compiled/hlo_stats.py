"""What a compiled XLA program does, read from its optimized HLO text (`compiled.as_text()`).

Read on programs compiled for a GPU target on a CPU-only machine (`compiled.gpu`,
benchmarks/gpu_compile.py, tests/test_gpu_compile.py): the kernels a loop
body launches, the bytes they write, the custom calls (cuBLAS, cuDNN attention) and the
collectives with the bytes each device receives. Definitions (docs/results/gpu-compile.md):

- A *kernel* is an instruction of an executed computation that launches work: every opcode
  but parameter, constant, get-tuple-element, tuple, bitcast, opt-barrier, add-dependency,
  after-all and the `*-done` half of an async pair (the `*-start` counts). `while`, `call`
  and `conditional` are not kernels: their computations are walked instead (a while body
  times its known trip count, a conditional's largest branch). A fusion is one kernel; its
  fused computation is not walked.
- *Bytes written* by a kernel are its output bytes, except an in-place update (a
  dynamic-update-slice or scatter, bare or as a fusion's root, or as an element of a fusion's
  root tuple): XLA writes it into its operand's buffer, so only the update's bytes count. A
  custom call's s8/u8 outputs (cuBLAS / cuDNN workspaces) are scratch and do not count.
- The bytes a device *receives* through a collective over n devices are the bandwidth-optimal
  (ring) volume: all-gather (n-1)/n x output, reduce-scatter (n-1) x output, all-reduce
  2(n-1)/n x size, all-to-all (n-1)/n x size, collective-permute the output.
"""

import dataclasses
import json
import math
import re
from collections.abc import Iterator, Sequence

import jax
import numpy as np

from mgrpo_jax import kv_cache_plan, sampling
from mgrpo_jax.models import qwen3

_DTYPE_BYTES = {"pred": 1, "s2": 0.25, "u2": 0.25, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1,
                "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4,
                "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16, "token": 0}
_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([0-9,]*)\]")
_HEADER = re.compile(r"^(ENTRY )?%([^\s(]+) \(")
_INSTR = re.compile(r"^\s*(ROOT )?%([^\s=]+) = (.*)$")
_FREE = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "opt-barrier",
         "add-dependency", "after-all", "while", "call", "conditional"}
COLLECTIVES = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all",
               "collective-permute", "ragged-all-to-all")
_IN_PLACE = ("dynamic-update-slice", "scatter")


@dataclasses.dataclass(frozen=True)
class Array:
  """One array of an instruction's (possibly tuple) shape."""
  dtype: str
  dims: tuple[int, ...]

  @property
  def size(self) -> int:
    return math.prod(self.dims)

  @property
  def bytes(self) -> float:
    return self.size * _DTYPE_BYTES.get(self.dtype, 4)


@dataclasses.dataclass
class Instr:
  name: str
  opcode: str
  shape: list[Array]       # Every array of the result (a tuple's elements, nested, flat).
  top: list[str]           # The result's top-level tuple elements as text (one if no tuple).
  operands: list[str]
  attrs: str
  root: bool

  def attr(self, key: str) -> str | None:
    m = re.search(rf"\b{key}=%([^\s,}}]+)", self.attrs)
    return m.group(1) if m else None

  @property
  def custom_call_target(self) -> str | None:
    m = re.search(r'custom_call_target="([^"]*)"', self.attrs)
    return m.group(1) if m else None

  @property
  def trip_count(self) -> int | None:
    m = re.search(r'"known_trip_count":\{"n":"(\d+)"', self.attrs)
    return int(m.group(1)) if m else None

  @property
  def op_name(self) -> str:
    m = re.search(r'op_name="([^"]*)"', self.attrs)
    return m.group(1) if m else ""

  @property
  def is_kernel(self) -> bool:
    return self.opcode not in _FREE and not self.opcode.endswith("-done")

  @property
  def collective(self) -> str | None:
    op = self.opcode.removesuffix("-start")
    return op if op in COLLECTIVES else None


@dataclasses.dataclass
class Computation:
  name: str
  instrs: dict[str, Instr]

  @property
  def root(self) -> Instr:
    return next(i for i in self.instrs.values() if i.root)


def _split_type(text: str) -> tuple[str, str]:
  """(the result type, the rest) of an instruction's right-hand side."""
  if not text.startswith("("):
    head, _, rest = text.partition(" ")
    return head, rest
  depth = 0
  for i, ch in enumerate(text):
    depth += {"(": 1, ")": -1}.get(ch, 0)
    if depth == 0:
      return text[:i + 1], text[i + 1:].lstrip()
  raise ValueError(f"unbalanced type: {text[:200]}")


def _top_level(type_text: str) -> list[str]:
  """A tuple type's top-level elements (comments dropped); [type_text] for an array."""
  if not type_text.startswith("("):
    return [type_text]
  inner = re.sub(r"/\*.*?\*/", "", type_text[1:-1])
  parts, depth, start = [], 0, 0
  for i, ch in enumerate(inner):
    depth += {"(": 1, ")": -1, "{": 1, "}": -1, "[": 1, "]": -1}.get(ch, 0)
    if ch == "," and depth == 0:
      parts.append(inner[start:i].strip())
      start = i + 1
  parts.append(inner[start:].strip())
  return [p for p in parts if p]


def arrays(type_text: str) -> list[Array]:
  """Every array in an HLO type (`bf16[2,3]{1,0}` or a tuple of them)."""
  return [Array(d, tuple(int(x) for x in s.split(",") if x)) for d, s in _ARRAY.findall(
      re.sub(r"\{[^{}]*\}", "", type_text))]


def _parse_instr(line: str) -> Instr | None:
  m = _INSTR.match(line)
  if not m:
    return None
  root, name, rhs = m.groups()
  type_text, rest = _split_type(rhs)
  op = re.match(r"([a-z][a-z0-9\-]*)\(", rest)
  if not op:
    return None
  depth, start = 0, op.end() - 1
  for i in range(start, len(rest)):
    depth += {"(": 1, ")": -1}.get(rest[i], 0)
    if depth == 0:
      break
  operands = re.findall(r"%([^\s,)]+)", rest[start:i + 1])
  return Instr(name, op.group(1), arrays(type_text), _top_level(type_text), operands,
               rest[i + 1:], bool(root))


@dataclasses.dataclass
class Module:
  """A parsed HLO module: its computations, the name of the entry one, and its stack frames
  (frame id -> function names, innermost first; see `stack_frames`)."""
  computations: dict[str, Computation]
  entry: str
  frames: dict[int, tuple[str, ...]] = dataclasses.field(default_factory=dict)

  @classmethod
  def parse(cls, text: str) -> "Module":
    comps, entry, current = {}, None, None
    for line in text.splitlines():
      h = _HEADER.match(line)
      if h:
        current = Computation(h.group(2), {})
        comps[current.name] = current
        entry = current.name if h.group(1) else entry
      elif line.startswith("}"):
        current = None
      elif current is not None:
        instr = _parse_instr(line)
        if instr is not None:
          current.instrs[instr.name] = instr
    if entry is None:
      raise ValueError("no ENTRY computation in the HLO text")
    return cls(comps, entry)

  # --- walking ---------------------------------------------------------------------------

  def executed(self, comp: str | None = None, times: float = 1.0
               ) -> Iterator[tuple[Instr, float, str]]:
    """(kernel, how many times it runs, the computation it is in) of everything `comp`
    (default: the entry) runs: while bodies and conditions times their known trip count
    (once if unknown), a conditional's largest branch, called computations."""
    c = self.computations[comp or self.entry]
    for instr in c.instrs.values():
      if instr.opcode == "while":
        n = instr.trip_count or 1
        yield from self.executed(instr.attr("body"), times * n)
        yield from self.executed(instr.attr("condition"), times * n)
      elif instr.opcode == "conditional":
        branches = re.findall(r"%([^\s,}]+)", (re.search(
            r"branch_computations=\{([^}]*)\}", instr.attrs) or [None, ""])[1])
        branches += [b for b in (instr.attr("true_computation"),
                                 instr.attr("false_computation")) if b]
        if branches:
          best = max(branches, key=lambda b: sum(1 for _ in self.executed(b)))
          yield from self.executed(best, times)
      elif instr.opcode in ("call", "async-start") and instr.attr("to_apply" if
                                                                  instr.opcode == "call"
                                                                  else "calls"):
        yield from self.executed(instr.attr("to_apply") or instr.attr("calls"), times)
      elif instr.is_kernel:
        yield instr, times, c.name

  def whiles(self, comp: str | None = None, depth: int = 0
             ) -> Iterator[tuple[Instr, int]]:
    """Every while instruction reachable from `comp` (default: the entry), with its nesting
    depth (0: not inside another loop)."""
    c = self.computations[comp or self.entry]
    for instr in c.instrs.values():
      if instr.opcode == "while":
        yield instr, depth
        yield from self.whiles(instr.attr("body"), depth + 1)
        yield from self.whiles(instr.attr("condition"), depth + 1)
      else:
        for key in ("to_apply", "true_computation", "false_computation"):
          if instr.opcode in ("call", "conditional") and instr.attr(key):
            yield from self.whiles(instr.attr(key), depth)
        if instr.opcode == "conditional":
          m = re.search(r"branch_computations=\{([^}]*)\}", instr.attrs)
          for b in re.findall(r"%([^\s,}]+)", m.group(1) if m else ""):
            yield from self.whiles(b, depth)

  def loop_kernels(self, loop: Instr) -> list[tuple[Instr, float, str]]:
    """What one iteration of the while `loop` runs (its body and condition)."""
    return (list(self.executed(loop.attr("body")))
            + list(self.executed(loop.attr("condition"))))

  def outer_loop(self) -> Instr:
    """The outermost while of unknown trip count with the most kernels: a decode loop."""
    loops = [w for w, depth in self.whiles() if depth == 0 and w.trip_count is None]
    if not loops:
      raise ValueError("no while loop of unknown trip count at the program's top level")
    return max(loops, key=lambda w: sum(t for _, t, _ in self.loop_kernels(w)))

  # --- per-kernel facts --------------------------------------------------------------------

  def operand_arrays(self, instr: Instr, comp: str) -> list[list[Array]]:
    c = self.computations[comp]
    return [c.instrs[o].shape if o in c.instrs else [] for o in instr.operands]

  def _written_by(self, instr: Instr, comp: str) -> float:
    """Bytes `instr` (an instruction of computation `comp`) writes; see the module doc."""
    if instr.opcode in _IN_PLACE:
      ops = self.operand_arrays(instr, comp)
      if instr.opcode == "dynamic-update-slice":
        return sum(a.bytes for a in ops[1])
      n = (len(ops) - 1) // 2  # scatter(operands..., indices, updates...)
      return sum(a.bytes for op in ops[n + 1:] for a in op)
    return sum(a.bytes for a in instr.shape)

  def bytes_written(self, instr: Instr, comp: str) -> float:
    """Bytes the kernel `instr` writes (module doc: in-place updates count their update)."""
    if instr.opcode == "fusion":
      fused = self.computations[instr.attr("calls")]
      root = fused.root
      if root.opcode == "tuple":
        return sum(self._written_by(fused.instrs[o], fused.name) if o in fused.instrs
                   else 0.0 for o in root.operands)
      return self._written_by(root, fused.name)
    if instr.opcode == "custom-call":
      return sum(a.bytes for a in instr.shape if a.dtype not in ("s8", "u8"))
    if instr.opcode.endswith("-start") and len(instr.top) > 1:
      return sum(a.bytes for a in arrays(instr.top[-1]))  # async (operands, outputs)
    return self._written_by(instr, comp)

  def reads_from(self, instr: Instr, comp: str) -> list[Array]:
    """The arrays the kernel `instr` takes as operands."""
    return [a for op in self.operand_arrays(instr, comp) for a in op]


def fusion_roots(module: Module, instr: Instr) -> list[str]:
  """The opcodes at a fusion's root (its tuple's elements), else [the opcode]."""
  if instr.opcode != "fusion":
    return [instr.opcode]
  fused = module.computations[instr.attr("calls")]
  root = fused.root
  if root.opcode == "tuple":
    return [fused.instrs[o].opcode for o in root.operands if o in fused.instrs]
  return [root.opcode]


# --- collectives ------------------------------------------------------------------------

def replica_groups(attrs: str, num_partitions: int) -> list[list[int]]:
  """The device groups of a collective, from its `replica_groups` in any of XLA's forms:
  explicit `{{0,1},{2,3}}`, iota `[2,2]<=[4]` (or `<=[2,2]T(1,0)`), or named mesh axes
  `mesh['axis_0'=2,'axis_1'=4] {'axis_1'}`. Empty or absent: one group of every partition."""
  m = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", attrs)
  if m:
    axes = re.findall(r"'([^']+)'=(\d+)", m.group(1))
    names, sizes = [a for a, _ in axes], [int(s) for _, s in axes]
    chosen = re.findall(r"'([^']+)'", m.group(2))
    ids = np.arange(math.prod(sizes)).reshape(sizes)
    keep = [i for i, a in enumerate(names) if a in chosen]
    rest = [i for i in range(len(names)) if i not in keep]
    ids = ids.transpose(rest + keep).reshape(-1, math.prod(sizes[i] for i in keep) or 1)
    return ids.tolist()
  m = re.search(r"replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", attrs)
  if m:
    shape = [int(x) for x in m.group(1).split(",")]
    ids = np.arange(math.prod(shape)).reshape([int(x) for x in m.group(2).split(",")])
    if m.group(3):
      ids = ids.transpose([int(x) for x in m.group(3).split(",")])
    return ids.reshape(shape[0], -1).tolist()
  m = re.search(r"replica_groups=\{(\{[^=]*?\})\}", attrs)
  if m:
    groups = [[int(x) for x in g.split(",") if x.strip()]
              for g in re.findall(r"\{([^{}]*)\}", m.group(1))]
    if groups and any(groups):
      return groups
  return [list(range(num_partitions))]


def received_bytes(instr: Instr, group_size: int) -> float:
  """Bytes one device receives through the collective `instr` over `group_size` devices
  (the ring volume; module doc)."""
  n = group_size
  if n <= 1:
    return 0.0
  out = sum(a.bytes for a in arrays(instr.top[-1])) if (
      instr.opcode.endswith("-start") and len(instr.top) > 1) else sum(
          a.bytes for a in instr.shape)
  kind = instr.collective
  if kind == "all-gather" or kind in ("all-to-all", "ragged-all-to-all"):
    return out * (n - 1) / n
  if kind == "reduce-scatter":
    return out * (n - 1)
  if kind == "all-reduce":
    return 2 * out * (n - 1) / n
  return out  # collective-permute


# --- summaries ----------------------------------------------------------------------------

def loop_summary(module: Module, loop: Instr, num_layers: int | None = None) -> dict:
  """Kernels, bytes written and custom calls of one iteration of `loop` (inner loops times
  their trip counts)."""
  runs = module.loop_kernels(loop)
  kernels = sum(t for _, t, _ in runs)
  written = sum(t * module.bytes_written(i, c) for i, t, c in runs)
  targets: dict[str, float] = {}
  for i, t, _ in runs:
    if i.custom_call_target:
      targets[i.custom_call_target] = targets.get(i.custom_call_target, 0) + t
  out = {"kernels": kernels, "bytes_written": written, "custom_calls": targets,
         "inner_loops": [w.trip_count for w, _ in module.whiles(loop.attr("body"))]}
  if num_layers:
    out["kernels_per_layer"] = kernels / num_layers
  return out


def top_writers(module: Module, loop: Instr, n: int = 8) -> list[dict]:
  """The kernels of one iteration of `loop` that write the most bytes."""
  runs = [(t * module.bytes_written(i, c), t, i) for i, t, c in module.loop_kernels(loop)]
  runs.sort(key=lambda r: -r[0])
  return [{"kernel": i.name, "roots": fusion_roots(module, i), "times": t,
           "bytes": b, "op": i.op_name[-120:]} for b, t, i in runs[:n]]


def collectives(module: Module, partitions: int, node_of: Sequence[int] | None = None
                ) -> list[dict]:
  """Every collective the program runs, with its count (trip counts multiplied), group size,
  bytes each device receives per run, and whether a group spans nodes (`node_of[p]`: the
  node of partition p; None: all one node)."""
  out = []
  for instr, times, _ in module.executed():
    kind = instr.collective
    if kind is None:
      continue
    groups = replica_groups(instr.attrs, partitions)
    n = max(len(g) for g in groups)
    crosses = node_of is not None and any(len({node_of[p] for p in g}) > 1 for g in groups)
    out.append({"kind": kind, "name": instr.name, "times": times, "group_size": n,
                "received_bytes": received_bytes(instr, n), "crosses_nodes": crosses,
                "arrays": [f"{a.dtype}{list(a.dims)}" for a in arrays(instr.top[-1])][:8],
                "op": instr.op_name[-160:]})
  return out


def loops_with(module: Module, function: str) -> list[Instr]:
  """The whiles whose source stack (the HLO's stack frames) passes through a function whose
  name contains `function` (a shard_map body's stack starts at its own function, e.g.
  `_local_chunked_logprobs` under `chunked_logprobs`)."""
  return [w for w, _ in module.whiles()
          if any(function in f for f in module.frames.get(_frame_id(w), ()))]


def _frame_id(instr: Instr) -> int | None:
  m = re.search(r"stack_frame_id=(\d+)", instr.attrs)
  return int(m.group(1)) if m else None


def parse(text: str) -> Module:
  """A Module with its stack frames (function names per frame id) attached."""
  module = Module.parse(text)
  module.frames = stack_frames(text)
  return module


def stack_frames(text: str) -> dict[int, tuple[str, ...]]:
  """Frame id -> the function names of that frame and its parents (outermost last), from the
  FileNames / FunctionNames / FileLocations / StackFrames sections of the HLO text."""
  def section(name):
    m = re.search(rf"^{name}\n(.*?)(?:\n\n|\Z)", text, re.S | re.M)
    return m.group(1).splitlines() if m else []
  funcs = {int(k): json.loads(v) for k, v in (
      line.split(" ", 1) for line in section("FunctionNames"))}
  locs = {}
  for line in section("FileLocations"):
    k, rest = line.split(" ", 1)
    m = re.search(r"function_name_id=(\d+)", rest)
    locs[int(k)] = funcs.get(int(m.group(1))) if m else None
  frames = {}
  for line in section("StackFrames"):
    k, rest = line.split(" ", 1)
    loc = re.search(r"file_location_id=(\d+)", rest)
    parent = re.search(r"parent_frame_id=(\d+)", rest)
    frames[int(k)] = (locs.get(int(loc.group(1))) if loc else None,
                      int(parent.group(1)) if parent else None)
  out = {}
  for k in frames:
    names, seen, cur = [], set(), k
    while cur in frames and cur not in seen:
      seen.add(cur)
      name, parent = frames[cur]
      if name:
        names.append(name)
      cur = parent if parent != cur else None
    out[k] = tuple(names)
  return out


# --- structural checks ------------------------------------------------------------------

def _outputs(module: Module, instr: Instr) -> list[Array]:
  """The arrays a kernel writes whole: its outputs but in-place updates (module doc)."""
  if instr.opcode in _IN_PLACE:
    return []
  if instr.opcode == "fusion":
    fused = module.computations[instr.attr("calls")]
    roots = ([fused.instrs[o] for o in fused.root.operands if o in fused.instrs]
             if fused.root.opcode == "tuple" else [fused.root])
    return [a for r in roots if r.opcode not in _IN_PLACE for a in r.shape]
  if instr.opcode.endswith("-start") and len(instr.top) > 1:
    return arrays(instr.top[-1])
  return [a for a in instr.shape
          if not (instr.opcode == "custom-call" and a.dtype in ("s8", "u8"))]


def copies(module: Module, loop: Instr, targets: dict[str, tuple[Array, int]]) -> list[dict]:
  """Kernels of one iteration of `loop` that copy part of a target array out: they read it
  and write, other than in place, an array of at least one slice's elements (a slice, a
  concatenation, a transpose or a cast of it). `targets`: name -> (the array as the program
  holds it, elements of one slice: size / layers for a stacked weight or cache, the size
  for a whole weight). Matmuls that read a weight in place write activations, far smaller."""
  found = []
  by_shape = {}
  for name, (arr, slice_elems) in targets.items():
    by_shape.setdefault(arr, []).append((name, slice_elems))
  for instr, times, comp in module.loop_kernels(loop):
    outs = _outputs(module, instr)
    if not outs:
      continue
    biggest = max(outs, key=lambda a: a.size)
    for arr in set(module.reads_from(instr, comp)):
      for name, slice_elems in by_shape.get(arr, ()):
        if biggest.size >= slice_elems:
          found.append({"kernel": instr.name, "target": name, "reads": f"{arr.dtype}"
                        f"{list(arr.dims)}", "writes": f"{biggest.dtype}{list(biggest.dims)}",
                        "cast": f"{arr.dtype}->{biggest.dtype}" if arr.dtype != biggest.dtype
                        else None, "times": times, "roots": fusion_roots(module, instr),
                        "op": instr.op_name[-120:]})
  return found


def loop_collectives(module: Module, loop: Instr, partitions: int) -> list[dict]:
  """The collectives one iteration of `loop` runs (see `collectives`)."""
  out = []
  for instr, times, _ in module.loop_kernels(loop):
    if instr.collective:
      n = max(len(g) for g in replica_groups(instr.attrs, partitions))
      out.append({"kind": instr.collective, "name": instr.name, "times": times,
                  "group_size": n, "received_bytes": received_bytes(instr, n),
                  "arrays": [f"{a.dtype}{list(a.dims)}" for a in arrays(instr.top[-1])][:8]})
  return out


_HLO_DTYPES = {"bfloat16": "bf16", "float32": "f32", "float16": "f16", "int32": "s32",
               "int8": "s8", "uint8": "u8", "bool": "pred", "float64": "f64", "int64": "s64"}


def array_of(shape: Sequence[int], dtype) -> Array:
  """The HLO Array of a JAX shape and dtype."""
  name = np.dtype(dtype).name
  return Array(_HLO_DTYPES.get(name, name), tuple(int(d) for d in shape))


def copy_targets(named: dict, num_layers: int) -> dict[str, tuple[Array, int]]:
  """`copies` targets from {name: (shape, dtype)} of weights and caches: a stacked array
  (leading axis of `num_layers`, at least 3 axes) by one layer's slice, any other array of 2+
  axes (embed, head, one layer's own weight or cache) whole; vectors and stacked norm scales
  [L, D] are skipped (reading one is cheap)."""
  out = {}
  for name, (shape, dtype) in named.items():
    size = math.prod(shape)
    if len(shape) >= 3 and shape[0] == num_layers:
      out[name] = (array_of(shape, dtype), size // num_layers)
    elif len(shape) >= 2 and not (len(shape) == 2 and shape[0] == num_layers):
      out[name] = (array_of(shape, dtype), size)
  return out


# --- the decode loop's per-step figures --------------------------------------------------

def named_arrays(tree) -> dict:
  """{path: (shape, dtype)} of a pytree of arrays or ShapeDtypeStructs."""
  return {jax.tree_util.keystr(p): (x.shape, x.dtype)
          for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def decode_step_stats(text: str, config, rows: int, capacity: int, *,
                      weights=None) -> dict:
  """Per step of the decode loop compiled in `text` (the sampler's `_decode_chunk` for a
  Qwen3 `config`, `rows` rows, a cache of `capacity` slots): see `step_stats`. `weights`:
  the pytree the loop reads its weights from (default the model's abstract params)."""
  weights = qwen3.abstract_params(config) if weights is None else weights
  cache = jax.eval_shape(lambda: sampling.init_cache(config, rows, capacity))
  return step_stats(text, [(config, weights, cache,
                            kv_cache_plan.kv_cache_bytes(config, rows, capacity))])


def step_stats(text: str, models: Sequence[tuple]) -> dict:
  """Per step of the decode loop compiled in `text`, which steps every model of `models`,
  each `(config, weights, cache, KV bytes a step attends over)` (weights and cache: the
  pytrees the loop reads): kernels (per layer, all models' layers together), bytes written
  beside the bytes a step must read (every weight in bf16, and the KV attended over),
  custom calls, and the kernels that copy or cast a slice of a stacked weight or cache or a
  whole 2-D weight (`copies`). `kernels_per_layer` is the step's kernels over the layers
  (the sampling and the head included)."""
  module = parse(text)
  loop = module.outer_loop()
  layers = sum(cfg.num_layers for cfg, *_ in models)
  summary = loop_summary(module, loop, layers)
  must_read = sum(cfg.num_params() * 2 + kv for cfg, _, _, kv in models)
  targets = {}
  for m, (cfg, weights, cache, _) in enumerate(models):
    named = copy_targets(named_arrays(weights) | named_arrays(cache), cfg.num_layers)
    targets |= {(f"model{m}" if len(models) > 1 else "") + k: v for k, v in named.items()}
  found = copies(module, loop, targets)
  layer_loops = [w for w, _ in module.whiles(loop.attr("body"))
                 if w.trip_count in {cfg.num_layers for cfg, *_ in models}]
  return {"kernels_per_step": summary["kernels"],
          "kernels_per_layer": summary["kernels_per_layer"],
          # One iteration of a loop over the layers, if the step has one (a layer scan).
          "kernels_per_layer_loop_iteration": [
              sum(t for _, t, _ in module.loop_kernels(w)) for w in layer_loops],
          "bytes_written_per_step_gb": summary["bytes_written"] / 1e9,
          "bytes_must_read_per_step_gb": must_read / 1e9,
          "written_to_read": summary["bytes_written"] / must_read,
          "custom_calls_per_step": summary["custom_calls"],
          # Kernels (times their runs) that copy, and those that cast while copying.
          "copies_per_step": sum({c["kernel"]: c["times"] for c in found}.values()),
          "casts_per_step": sum({c["kernel"]: c["times"] for c in found if c["cast"]}.values()),
          "copies": sorted({(c["target"], c["reads"], c["writes"], c["cast"] or "")
                            for c in found}),
          "top_writers": top_writers(module, loop, 6)}
