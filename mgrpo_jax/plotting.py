"""Training curves from runs' metrics.jsonl files, one panel per metric (matplotlib Agg)."""

import os
from typing import Callable, Mapping, Sequence

import numpy as np

from mgrpo_jax import metrics as metrics_lib


class UnknownMetricError(KeyError):
  """A key to plot that no run's metrics hold; the message names the keys that exist."""

  def __str__(self):
    return str(self.args[0])


def _label(workdir: str, taken: set) -> str:
  """The run dir's name; its parent is prepended when two runs share a name."""
  path = os.path.normpath(workdir)
  label = os.path.basename(path)
  if label in taken:
    label = os.path.join(os.path.basename(os.path.dirname(path)), label)
  taken.add(label)
  return label


def load_runs(workdirs_or_runs) -> dict[str, list[dict]]:
  """{label: records} from workdirs (labelled by dir name) or an existing mapping."""
  if isinstance(workdirs_or_runs, Mapping):
    return {k: (metrics_lib.read_metrics(v) if isinstance(v, (str, os.PathLike)) else list(v))
            for k, v in workdirs_or_runs.items()}
  if isinstance(workdirs_or_runs, (str, os.PathLike)):
    workdirs_or_runs = [workdirs_or_runs]
  taken = set()
  return {_label(str(w), taken): metrics_lib.read_metrics(str(w)) for w in workdirs_or_runs}


def series(records: Sequence[dict], key: str) -> tuple[np.ndarray, np.ndarray]:
  """(steps, values) of `key`: lines without it and non-finite values are skipped.

  A step written twice (a resume without truncation) keeps its last value.
  """
  points = {}
  for r in records:
    v = r.get(key)
    if isinstance(v, (bool, int, float)) and np.isfinite(v):
      points[int(r["step"])] = float(v)
  steps = np.array(sorted(points), dtype=np.int64)
  return steps, np.array([points[s] for s in steps], dtype=np.float64)


def ema(values: np.ndarray, smooth: float) -> np.ndarray:
  """TensorBoard-style debiased exponential moving average (smooth=0: unchanged)."""
  if not 0.0 <= smooth < 1.0:
    raise ValueError(f"smooth must be in [0, 1), got {smooth}.")
  out, acc, weight = np.empty_like(values), 0.0, 0.0
  for i, v in enumerate(values):
    acc = smooth * acc + (1 - smooth) * v
    weight = smooth * weight + (1 - smooth)
    out[i] = acc / weight  # Debiasing: early points are not pulled towards 0.
  return out


def t_interval(values_RxN: np.ndarray, confidence: float = 0.95) -> tuple[np.ndarray, np.ndarray]:
  """(mean, half-width) over runs (axis 0) of Student's t interval: t_{(1+c)/2, R-1} * s / sqrt(R).

  s is the sample standard deviation (ddof=1); with a single run the half-width is NaN.
  """
  from scipy import stats  # A dependency of jax.

  values_RxN = np.asarray(values_RxN, np.float64)
  runs = values_RxN.shape[0]
  mean = values_RxN.mean(axis=0)
  if runs < 2:
    return mean, np.full_like(mean, np.nan)
  sem = values_RxN.std(axis=0, ddof=1) / np.sqrt(runs)
  return mean, stats.t.ppf((1 + confidence) / 2, runs - 1) * sem


def _grouper(group_by) -> Callable[[str], str]:
  if group_by is None:
    return lambda label: label
  if callable(group_by):
    return group_by
  # A separator: "mgrpo_seed3" grouped by "_seed" -> "mgrpo".
  return lambda label: os.path.basename(label).rsplit(group_by, 1)[0]


def plot_curves(workdirs_or_runs, keys: Sequence[str] | None, out_png: str, *,
                smooth: float = 0.0, group_by: str | Callable[[str], str] | None = None,
                ncols: int = 3, title: str | None = None, band: str = "minmax") -> str:
  """Plots `keys` of several runs into `out_png` and returns its path.

  `workdirs_or_runs` is a list of run directories (or {label: workdir or records}).
  With `group_by` (a separator such as "_seed", or label -> group), runs of a group
  are drawn as their mean with a band over the steps all of them reached: min-max
  (`band="minmax"`) or the 95% t-interval of the mean over the group's runs (`band="t95"`).
  `keys=None` plots every numeric key. Smoothing is applied per run, before grouping.
  """
  import matplotlib
  matplotlib.use("Agg")  # No display on servers; must precede pyplot's import.
  import matplotlib.pyplot as plt

  runs = load_runs(workdirs_or_runs)
  known = sorted({k for recs in runs.values() for r in recs for k, v in r.items()
                  if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)})
  if keys is None:
    keys = known
  if not keys:
    raise UnknownMetricError(f"No metric keys to plot: the runs {list(runs)} hold no records.")
  unknown = [k for k in keys if k not in known]
  if unknown:
    raise UnknownMetricError(f"No run holds the key(s) {', '.join(unknown)}; the keys that "
                             f"exist: {', '.join(known)}.")
  groups = {}
  for label in runs:
    groups.setdefault(_grouper(group_by)(label), []).append(label)

  ncols = max(1, min(ncols, len(keys)))
  nrows = -(-len(keys) // ncols)
  fig, axes = plt.subplots(nrows, ncols, figsize=(4.5 * ncols, 3.2 * nrows), squeeze=False)
  for ax, key in zip(axes.flat, keys):
    for i, (group, labels) in enumerate(groups.items()):
      color = f"C{i % 10}"
      curves = [series(runs[label], key) for label in labels]
      curves = [(s, ema(v, smooth)) for s, v in curves if len(s)]
      if not curves:
        continue
      if group_by is None or len(curves) == 1:
        steps, values = curves[0]
        ax.plot(steps, values, color=color, label=group, marker="." if len(steps) < 30 else None)
        continue
      steps, stack = _aligned(curves)
      if band == "t95":
        mean, half = t_interval(stack)
        low, high = mean - half, mean + half
      elif band == "minmax":
        low, high = stack.min(0), stack.max(0)
      else:
        raise ValueError(f"band={band!r}; expected 'minmax' or 't95'.")
      ax.plot(steps, stack.mean(0), color=color, label=f"{group} (n={len(curves)})")
      ax.fill_between(steps, low, high, color=color, alpha=0.2, linewidth=0)
    ax.set_title(key)
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)
    if ax.lines:
      ax.legend(fontsize="small")
  for ax in axes.flat[len(keys):]:
    ax.axis("off")
  if title:
    fig.suptitle(title)
  fig.tight_layout()
  os.makedirs(os.path.dirname(os.path.abspath(out_png)), exist_ok=True)
  fig.savefig(out_png, dpi=100)
  plt.close(fig)
  return out_png


def _aligned(curves) -> tuple[np.ndarray, np.ndarray]:
  """Steps common to every curve and a [runs, steps] stack of their values there."""
  common = curves[0][0]
  for steps, _ in curves[1:]:
    common = np.intersect1d(common, steps)
  stack = np.stack([values[np.searchsorted(steps, common)] for steps, values in curves])
  return common, stack
