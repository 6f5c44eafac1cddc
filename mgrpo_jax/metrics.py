"""Run metrics: a JSON-lines file, TensorBoard and W&B scalars, a progress bar, late fetching.

`workdir/metrics.jsonl` holds one JSON object per written step, e.g.
`{"step": 3, "main/reward": 0.5, "eval/accuracy": 0.25}`; keys that are measured only
sometimes (evaluation) appear only on those lines. Non-finite floats are written as
the strings "nan", "inf" and "-inf" (strict JSON has no NaN), and `read_metrics`
turns them back into floats, so the file stays valid JSON and nothing is lost.

A run's `config.log_to` names its sinks (`open_writer`): "jsonl" (always: resume, plots
and evaluation read it), "tensorboard" (`workdir/tb/`) and "wandb" (Weights & Biases, the
optional `wandb` extra: the run's config and its numeric curves, to `config.wandb.project`
/ `config.wandb.name`; a resumed workdir continues the same W&B run, whose id it keeps in
`wandb_run.json`).
"""

import json
import math
import os
import secrets
import sys
import time
from typing import Any, Mapping

import jax
import numpy as np
import tqdm
from absl import logging

METRICS_FILE = "metrics.jsonl"
WANDB_RUN_FILE = "wandb_run.json"  # The workdir's W&B run id: a resume continues that run.
SINKS = ("jsonl", "tensorboard", "wandb")
DEFAULT_LOG_TO = "jsonl,tensorboard"  # What a run without `config.log_to` writes.
# Prefixes of keys that differ between two runs of the same steps (wall time, throughput,
# device memory): what a bit-identical resume or a cross-program comparison leaves out.
VOLATILE = ("time/", "tokens_per_s", "mem/")
_NONFINITE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


def _to_py(x):
  """A JSON-ready Python value: jax/numpy scalars unboxed, non-finite floats as strings."""
  if isinstance(x, (jax.Array, np.ndarray, np.generic)):
    x = np.asarray(x)
    x = x.item() if x.ndim == 0 else x.tolist()
  if isinstance(x, (list, tuple)):
    return [_to_py(v) for v in x]
  if isinstance(x, float) and not math.isfinite(x):
    return "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")
  if x is None or isinstance(x, (bool, int, float, str)):
    return x
  raise TypeError(f"Metric value of type {type(x).__name__} is not a number, string or list.")


def flatten(metrics: Mapping, prefix: str = "") -> dict:
  """{"main": {"loss": 1}} -> {"main/loss": 1}."""
  out = {}
  for k, v in metrics.items():
    name = f"{prefix}{k}"
    if isinstance(v, Mapping):
      out.update(flatten(v, name + "/"))
    else:
      out[name] = v
  return out


def _from_json(x):
  if isinstance(x, str) and x in _NONFINITE:
    return _NONFINITE[x]
  if isinstance(x, list):
    return [_from_json(v) for v in x]
  return x


def _read_lines(path: str) -> list[dict]:
  """Records of a metrics file; a torn last line (crash mid-write) is skipped."""
  records = []
  with open(path) as f:
    for i, line in enumerate(f):
      if not line.strip():
        continue
      try:
        records.append(json.loads(line))
      except json.JSONDecodeError:
        logging.warning("Skipping unreadable line %d of %s.", i + 1, path)
  return records


def device_memory() -> dict:
  """{"mem/peak_gb", "mem/limit_gb"}: the fullest local device's peak allocation since start.

  Empty where the backend keeps no allocator statistics (CPU); on GPU the peak is the
  allocator's high-water mark (`memory_stats()["peak_bytes_in_use"]`), never reset, so a
  step's value is the peak of the run so far.
  """
  stats = [s for s in (d.memory_stats() for d in jax.local_devices()) if s]
  stats = [s for s in stats if "peak_bytes_in_use" in s]
  if not stats:
    return {}
  fullest = max(stats, key=lambda s: s["peak_bytes_in_use"])
  out = {"mem/peak_gb": fullest["peak_bytes_in_use"] / 1e9}
  if "bytes_limit" in fullest:
    out["mem/limit_gb"] = fullest["bytes_limit"] / 1e9
  return out


def stable(records: list[dict]) -> list[dict]:
  """`records` without their `VOLATILE` keys."""
  return [{k: v for k, v in r.items() if not k.startswith(VOLATILE)} for r in records]


def read_metrics(workdir: str) -> list[dict]:
  """All records of `workdir/metrics.jsonl` (or of that file itself), in file order."""
  path = workdir if os.path.isfile(workdir) else os.path.join(workdir, METRICS_FILE)
  return [{k: _from_json(v) for k, v in r.items()} for r in _read_lines(path)]


def _summary_writer_class():
  """tensorboardX's `SummaryWriter`, imported late (it is optional) and without torch.

  tensorboardX imports torch whenever it is installed, only to accept torch tensors; this
  writer passes Python floats. Importing torch took 2.6 of tensorboardX's 3.7 s on 2 cores,
  in every program that writes metrics (the test extras install torch for the HF parity
  tests); without it tensorboardX takes 0.9 s. A process that already imported torch keeps
  it.
  """
  if "torch" in sys.modules:
    from tensorboardX import SummaryWriter
    return SummaryWriter
  sys.modules["torch"] = None  # `import torch` raises ImportError while this is set.
  try:
    from tensorboardX import SummaryWriter
  finally:
    if sys.modules.get("torch", 0) is None:
      del sys.modules["torch"]
  return SummaryWriter


class MetricsWriter:
  """Appends per-step metrics to `workdir/metrics.jsonl`, TensorBoard (`workdir/tb/`) and,
  when asked, Weights & Biases.

  Each `write` is flushed to the OS at once, so a crashed process loses nothing it
  wrote. Only process 0 writes (others are silent) unless `enabled` says otherwise.
  """

  def __init__(self, workdir: str, *, tensorboard: bool = True, wandb: dict | None = None,
               enabled: bool | None = None):
    """`wandb`: `wandb_init`'s keyword arguments (project, name, entity, config) to log to
    Weights & Biases too; None: not."""
    self.workdir = workdir
    self.path = os.path.join(workdir, METRICS_FILE)
    self.enabled = jax.process_index() == 0 if enabled is None else enabled
    self._tensorboard = tensorboard and self.enabled
    self._file = self._tb = self._wandb = None
    if self.enabled:
      os.makedirs(workdir, exist_ok=True)
      self._file = open(self.path, "a")
      self._open_tb()
      if wandb is not None:
        self._wandb = wandb_init(workdir, **wandb)

  def _open_tb(self, purge_step: int | None = None):
    if not self._tensorboard:
      return
    try:
      SummaryWriter = _summary_writer_class()
    except ImportError:
      logging.warning("tensorboardX is not installed; metrics go to %s only.", self.path)
      self._tensorboard = False
      return
    if self._tb is not None:
      self._tb.close()
    # purge_step tells TensorBoard to hide events at and after it from a crashed run.
    self._tb = SummaryWriter(os.path.join(self.workdir, "tb"), purge_step=purge_step)

  def write(self, step: int, metrics: Mapping[str, Any]):
    """Writes one record {"step": step, **metrics}; nested dicts become "a/b" keys."""
    if not self.enabled:
      return
    flat = flatten(metrics)
    if "step" in flat:
      raise ValueError("Metric name 'step' is reserved for the step number.")
    record = {"step": int(step), **{k: _to_py(v) for k, v in flat.items()}}
    self._file.write(json.dumps(record, allow_nan=False) + "\n")
    self._file.flush()
    if self._tb is not None:
      for k, v in record.items():
        v = _from_json(v)  # TensorBoard plots NaN/inf natively.
        if k != "step" and isinstance(v, (bool, int, float)):
          self._tb.add_scalar(k, float(v), int(step))
      self._tb.flush()
    # W&B cannot rewrite a step it holds (a resume redoes the steps after its checkpoint,
    # with the same values but wall times): those are left as the first run wrote them.
    if self._wandb is not None and step >= self._wandb.step:
      self._wandb.log(_numbers(record), step=int(step))

  def truncate_after(self, step: int):
    """Drops records of steps > `step` (a resumed run rewrites them), and torn lines.

    The file is rewritten to a temporary name and renamed over the old one, so a
    crash here leaves either the old or the new file, never a mix.
    """
    if not self.enabled:
      return
    self._file.close()
    kept = [r for r in _read_lines(self.path) if int(r["step"]) <= step]
    tmp = self.path + ".tmp"
    with open(tmp, "w") as f:
      f.writelines(json.dumps(r) + "\n" for r in kept)
    os.replace(tmp, self.path)
    self._file = open(self.path, "a")
    self._open_tb(purge_step=step + 1)

  def close(self):
    if self._file is not None:
      self._file.close()
      self._file = None
    if self._tb is not None:
      self._tb.close()
      self._tb = None
    if self._wandb is not None:
      self._wandb.finish()
      self._wandb = None

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()


def _numbers(record: dict) -> dict:
  """The scalars of a written record (not its step, strings or lists) as floats."""
  out = {}
  for k, v in record.items():
    v = _from_json(v)
    if k != "step" and isinstance(v, (bool, int, float)):
      out[k] = float(v)
  return out


def parse_log_to(log_to: str) -> tuple[str, ...]:
  """The sinks of `config.log_to` ("jsonl,tensorboard,wandb"); raises ValueError for an
  unknown one, or one list without "jsonl" (the run's own record)."""
  sinks = tuple(dict.fromkeys(s.strip() for s in log_to.split(",") if s.strip()))
  unknown = [s for s in sinks if s not in SINKS]
  if unknown:
    raise ValueError(f"config.log_to={log_to!r}: unknown sink(s) {unknown}; known: "
                     f"{', '.join(SINKS)}.")
  if "jsonl" not in sinks:
    raise ValueError(f"config.log_to={log_to!r} must include 'jsonl': {METRICS_FILE} is the "
                     "run's own record (resume, plots and evaluation read it).")
  return sinks


def open_writer(workdir: str) -> MetricsWriter:
  """The writer of the run in `workdir`, with the sinks its `config.json` names
  (`config.log_to`; a workdir without one, or a config without the field: jsonl and
  TensorBoard)."""
  path = os.path.join(workdir, "config.json")
  config = {}
  if jax.process_index() == 0 and os.path.exists(path):  # Only process 0 writes metrics.
    with open(path) as f:
      config = json.load(f)
  sinks = parse_log_to(config.get("log_to", DEFAULT_LOG_TO))
  wandb = None
  if "wandb" in sinks:
    w = config.get("wandb", {})
    wandb = dict(project=w.get("project") or None, name=w.get("name") or None,
                 entity=w.get("entity") or None, config=config)
  return MetricsWriter(workdir, tensorboard="tensorboard" in sinks, wandb=wandb)


def wandb_init(workdir: str, *, project: str | None = None, name: str | None = None,
               entity: str | None = None, config: dict | None = None):
  """A W&B run for `workdir` (its files under `workdir/wandb/`): the one whose id the workdir
  keeps, continued, or a new one whose id it then keeps. W&B's own settings apply (e.g.
  WANDB_MODE=offline writes the run there for a later `wandb sync`)."""
  import wandb  # The optional extra: imported only by a run that logs to W&B.

  id_path = os.path.join(workdir, WANDB_RUN_FILE)
  if os.path.exists(id_path):
    with open(id_path) as f:
      run_id = json.load(f)["id"]
  else:
    run_id = secrets.token_hex(6)  # W&B run ids: lowercase letters and digits.
    with open(id_path, "w") as f:
      json.dump({"id": run_id}, f)
  return wandb.init(project=project, name=name, entity=entity, id=run_id, resume="allow",
                    dir=workdir, config=config)


def format_value(v) -> str:
  """A metric value for a log line: floats to 4 significant digits."""
  if isinstance(v, float) or isinstance(v, (np.floating, jax.Array)):
    return f"{float(v):.4g}"
  return str(v)


class Progress:
  """A tqdm bar with ETA and a few metrics, shown only on a terminal.

  In CI logs (stderr not a TTY) the bar is off unless `force=True`; with
  `log_every=N` a plain absl log line with rate, ETA and the metrics is written
  every N steps instead.
  """

  def __init__(self, total: int, initial: int = 0, desc: str = "", *, force: bool | None = None,
               log_every: int | None = None):
    enabled = sys.stderr.isatty() if force is None else force
    self._bar = tqdm.tqdm(total=total, initial=initial, desc=desc, disable=not enabled,
                          dynamic_ncols=True, smoothing=0.1)
    self.total, self.n, self._start_n, self.desc = total, initial, initial, desc
    self._log_every = log_every
    self._t0 = time.monotonic()
    self._postfix = {}

  def postfix(self, metrics: Mapping[str, Any]):
    """Shows `metrics` (pick a few: reward, accuracy) after the bar."""
    self._postfix = {k: format_value(v) for k, v in metrics.items()}
    self._bar.set_postfix(self._postfix, refresh=False)

  def update(self, n: int = 1, metrics: Mapping[str, Any] | None = None):
    """Advances by `n` steps, optionally replacing the shown metrics."""
    if metrics is not None:
      self.postfix(metrics)
    self.n += n
    self._bar.update(n)
    if self._log_every and self._bar.disable and self.n % self._log_every == 0:
      logging.info("%s", self.summary())

  def summary(self) -> str:
    """'desc step 12/100 (0.5 step/s, ETA 02:56) key=value ...' for logs."""
    elapsed = time.monotonic() - self._t0
    rate = (self.n - self._start_n) / elapsed if elapsed > 0 else 0.0
    eta = tqdm.tqdm.format_interval((self.total - self.n) / rate) if rate > 0 else "?"
    post = " ".join(f"{k}={v}" for k, v in self._postfix.items())
    return f"{self.desc} step {self.n}/{self.total} ({rate:.3g} step/s, ETA {eta}) {post}".strip()

  def close(self):
    self._bar.close()
