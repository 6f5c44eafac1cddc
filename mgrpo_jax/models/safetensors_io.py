"""A small, dependency-free reader and writer of the safetensors format.

Own code instead of `safetensors.numpy` because bfloat16 needs `ml_dtypes` views of
memory-mapped files, and we want to read one tensor at a time without torch.
"""

import json
import os
import struct

import ml_dtypes
import numpy as np

_TO_NUMPY = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8,
    "BOOL": np.bool_,
}
_FROM_NUMPY = {np.dtype(v): k for k, v in _TO_NUMPY.items()}
FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")
_MAX_HEADER_BYTES = 100 << 20  # The format's own limit.


class CheckpointError(ValueError):
  """A checkpoint file or directory is missing, malformed or does not fit the model."""


def read_header(path: str) -> tuple[dict, int]:
  """Returns ({name: {dtype, shape, data_offsets}}, byte offset of the data)."""
  try:
    with open(path, "rb") as f:
      raw = f.read(8)
      if len(raw) != 8:
        raise CheckpointError(f"{path}: too short to be a safetensors file.")
      (n,) = struct.unpack("<Q", raw)
      if n > min(os.path.getsize(path) - 8, _MAX_HEADER_BYTES):
        raise CheckpointError(f"{path}: header length {n} exceeds the file size or "
                              f"{_MAX_HEADER_BYTES} bytes.")
      header = json.loads(f.read(n))
  except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
    raise CheckpointError(f"{path}: cannot read safetensors header: {e}") from e
  if not isinstance(header, dict):
    raise CheckpointError(f"{path}: the safetensors header is not a JSON object.")
  header.pop("__metadata__", None)
  for name, info in header.items():
    _check_entry(path, name, info)
  return header, 8 + n


def _check_entry(path: str, name: str, info) -> None:
  """Each tensor entry typed strictly: a known dtype, a shape and two data offsets."""
  is_int = lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0
  ok = (isinstance(info, dict) and info.get("dtype") in _TO_NUMPY
        and isinstance(info.get("shape"), list) and all(map(is_int, info["shape"]))
        and isinstance(info.get("data_offsets"), list) and len(info["data_offsets"]) == 2
        and all(map(is_int, info["data_offsets"])))
  if not ok:
    raise CheckpointError(f"{path}: tensor {name!r} has a malformed header entry "
                          f"{json.dumps(info)[:200]} (or an unsupported dtype).")


class SafetensorsFile:
  """Memory-mapped tensors of one file; `read(name)` copies nothing until sliced."""

  def __init__(self, path: str):
    self.path = path
    self.header, self._data_start = read_header(path)
    self._mmap = None
    # Check every tensor's byte range now, so a truncated file fails by name at open.
    data_len = os.path.getsize(path) - self._data_start
    for name, info in self.header.items():
      start, end = info["data_offsets"]
      if not 0 <= start <= end <= data_len:
        raise CheckpointError(
            f"{path}: tensor {name!r} spans bytes [{start}, {end}) of the data, but the file "
            f"holds only {data_len} data bytes (truncated?).")

  def names(self) -> list[str]:
    return list(self.header)

  def shape(self, name: str) -> tuple[int, ...]:
    return tuple(self.header[name]["shape"])

  def dtype(self, name: str) -> str:
    """The safetensors dtype name, e.g. "BF16"."""
    return self.header[name]["dtype"]

  def read(self, name: str) -> np.ndarray:
    info = self.header[name]
    if info["dtype"] not in _TO_NUMPY:
      raise CheckpointError(f"{self.path}: tensor {name!r} has unsupported dtype {info['dtype']}.")
    if self._mmap is None:
      self._mmap = np.memmap(self.path, dtype=np.uint8, mode="r")
    start, end = info["data_offsets"]
    dtype = np.dtype(_TO_NUMPY[info["dtype"]])
    shape = tuple(info["shape"])
    if end - start != int(np.prod(shape, dtype=np.int64)) * dtype.itemsize:
      raise CheckpointError(
          f"{self.path}: tensor {name!r} has {end - start} bytes, but shape {shape} "
          f"of {info['dtype']} needs {int(np.prod(shape)) * dtype.itemsize}.")
    buf = self._mmap[self._data_start + start:self._data_start + end]
    return buf.view(dtype).reshape(shape)


def write(path: str, tensors: dict[str, np.ndarray], metadata: dict | None = None) -> None:
  """Writes `tensors` to `path` (via a temporary file, so a crash leaves no half file)."""
  header, offset = {}, 0
  for name, arr in tensors.items():
    if arr.dtype not in _FROM_NUMPY:
      raise CheckpointError(f"Cannot write tensor {name!r} of dtype {arr.dtype}.")
    header[name] = {"dtype": _FROM_NUMPY[arr.dtype], "shape": list(arr.shape),
                    "data_offsets": [offset, offset + arr.nbytes]}
    offset += arr.nbytes
  # transformers refuses files whose metadata lacks a known "format".
  header["__metadata__"] = {"format": "pt", **(metadata or {})}
  blob = json.dumps(header, separators=(",", ":")).encode()
  blob += b" " * (-len(blob) % 8)  # The data must start 8-byte aligned.
  tmp = path + ".tmp"
  with open(tmp, "wb") as f:
    f.write(struct.pack("<Q", len(blob)))
    f.write(blob)
    for arr in tensors.values():
      f.write(np.ascontiguousarray(arr).tobytes())
  os.replace(tmp, path)
