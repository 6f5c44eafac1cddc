"""Metrics files, TensorBoard output, late fetching, progress logging and curve plots."""

import glob
import json
import math
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mgrpo_jax import metrics, plotting


def _lines(workdir):
  with open(os.path.join(workdir, metrics.METRICS_FILE)) as f:
    return f.read().splitlines()


def test_jsonl_is_strict_json_with_steps(tmp_path):
  with metrics.MetricsWriter(str(tmp_path)) as w:
    w.write(0, {"loss": jnp.float32(0.5), "count": np.int64(3), "ok": jnp.bool_(True),
                "main": {"reward": 1.0}, "name": "x", "hist": np.array([1.0, np.inf])})
    w.write(1, {"loss": float("nan"), "up": np.float32(np.inf), "down": -math.inf})
    # Written and flushed before close: a crash after `write` loses nothing.
    assert len(_lines(tmp_path)) == 2
  lines = _lines(tmp_path)
  # Strict parsing: NaN/Infinity literals would be rejected here.
  strict = [json.loads(l, parse_constant=lambda c: pytest.fail(f"non-JSON {c}")) for l in lines]
  assert strict[0] == {"step": 0, "loss": 0.5, "count": 3, "ok": True, "main/reward": 1.0,
                       "name": "x", "hist": [1.0, "inf"]}
  assert type(strict[0]["count"]) is int and type(strict[0]["loss"]) is float
  assert strict[1] == {"step": 1, "loss": "nan", "up": "inf", "down": "-inf"}
  back = metrics.read_metrics(str(tmp_path))
  assert math.isnan(back[1]["loss"]) and back[1]["up"] == math.inf and back[1]["down"] == -math.inf
  assert back[0]["hist"] == [1.0, math.inf]


def test_reserved_step_key(tmp_path):
  with metrics.MetricsWriter(str(tmp_path), tensorboard=False) as w:
    with pytest.raises(ValueError):
      w.write(0, {"step": 1})


def test_tensorboard_events_written(tmp_path):
  with metrics.MetricsWriter(str(tmp_path)) as w:
    w.write(0, {"main/reward": 0.25, "name": "not a scalar"})
  events = glob.glob(os.path.join(tmp_path, "tb", "events.out.tfevents.*"))
  assert events and os.path.getsize(events[0]) > 0
  with open(events[0], "rb") as f:
    assert b"main/reward" in f.read()


def test_tensorboard_events_need_no_torch(tmp_path):
  # tensorboardX imports torch when it is installed: 2.6 s in every program that writes
  # metrics. The writer imports it without torch, and torch still imports afterwards.
  code = f"""
import importlib.util, sys
from mgrpo_jax import metrics
with metrics.MetricsWriter({str(tmp_path)!r}) as w:
  w.write(0, {{"main/reward": 0.5}})
assert "tensorboardX" in sys.modules and "torch" not in sys.modules, sorted(sys.modules)
if importlib.util.find_spec("torch") is not None:
  import torch
  assert torch.zeros(2).sum().item() == 0.0
"""
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
  r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
  assert r.returncode == 0, r.stderr[-3000:]
  assert glob.glob(os.path.join(tmp_path, "tb", "events.out.tfevents.*"))


def test_truncate_after_resume(tmp_path):
  workdir = str(tmp_path)
  with metrics.MetricsWriter(workdir, tensorboard=False) as w:
    for step in range(5):
      w.write(step, {"x": step})
  with open(os.path.join(workdir, metrics.METRICS_FILE), "a") as f:
    f.write('{"step": 5, "x"')  # Torn by a crash mid-write.
  # Resume from a checkpoint taken after step 2: steps 3.. are redone.
  with metrics.MetricsWriter(workdir, tensorboard=False) as w:
    w.truncate_after(2)
    for step in range(3, 6):
      w.write(step, {"x": 10 * step})
  records = metrics.read_metrics(workdir)
  assert [r["step"] for r in records] == [0, 1, 2, 3, 4, 5]
  assert [r["x"] for r in records] == [0, 1, 2, 30, 40, 50]
  assert all(json.loads(l) for l in _lines(workdir))


def test_truncate_everything_on_fresh_start(tmp_path):
  with metrics.MetricsWriter(str(tmp_path)) as w:
    w.write(0, {"x": 1})
    w.truncate_after(-1)
    w.write(0, {"x": 2})
  assert metrics.read_metrics(str(tmp_path)) == [{"step": 0, "x": 2}]


def test_disabled_writer_writes_nothing(tmp_path):
  w = metrics.MetricsWriter(str(tmp_path / "w"), enabled=False)
  w.write(0, {"x": 1})
  w.truncate_after(0)
  w.close()
  assert not os.path.exists(tmp_path / "w")


def test_progress_logs_when_not_a_tty(caplog):
  caplog.set_level("INFO")
  p = metrics.Progress(10, initial=4, desc="train", force=False, log_every=2)
  p.update(1, {"reward": 0.123456})
  p.update(1)
  p.close()
  lines = [r.getMessage() for r in caplog.records if "train" in r.getMessage()]
  assert len(lines) == 1 and "6/10" in lines[0] and "reward=0.1235" in lines[0]
  assert "ETA" in lines[0]


def _fake_run(root, name, steps, slope, eval_every=2):
  workdir = os.path.join(root, name)
  with metrics.MetricsWriter(workdir, tensorboard=False) as w:
    for s in range(steps):
      m = {"main/reward": slope * s}
      if s % eval_every == 0:
        m["eval/accuracy"] = 0.1 * s
      w.write(s, m)
  return workdir


def test_plot_curves_png(tmp_path):
  runs = [_fake_run(tmp_path, "mgrpo", 10, 0.1), _fake_run(tmp_path, "grpo", 6, 0.05)]
  out = plotting.plot_curves(runs, ["main/reward", "eval/accuracy"], str(tmp_path / "c.png"),
                             smooth=0.5)
  with open(out, "rb") as f:
    assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_plot_grouped_seeds(tmp_path):
  runs = [_fake_run(tmp_path, f"mgrpo_seed{i}", 8 + i, 0.1 * (i + 1)) for i in range(3)]
  out = plotting.plot_curves(runs, None, str(tmp_path / "g.png"), group_by="_seed")
  with open(out, "rb") as f:
    assert f.read(4) == b"\x89PNG"
  # Grouping aligns on the steps every seed reached.
  curves = [plotting.series(metrics.read_metrics(r), "eval/accuracy") for r in runs]
  steps, stack = plotting._aligned(curves)
  np.testing.assert_array_equal(steps, [0, 2, 4, 6])
  assert stack.shape == (3, 4)


def test_series_skips_missing_and_nonfinite():
  records = [{"step": 0, "a": 1.0}, {"step": 1}, {"step": 2, "a": math.nan}, {"step": 3, "a": 4}]
  steps, values = plotting.series(records, "a")
  np.testing.assert_array_equal(steps, [0, 3])
  np.testing.assert_array_equal(values, [1.0, 4.0])


def test_ema_debiased():
  np.testing.assert_allclose(plotting.ema(np.array([2.0, 2.0, 2.0]), 0.9), [2.0, 2.0, 2.0])
  np.testing.assert_allclose(plotting.ema(np.array([0.0, 1.0]), 0.5), [0.0, 0.5 / 0.75])


def test_t_interval_by_hand():
  # Runs (1, 2, 3) at one step: mean 2, s = 1, t_{0.975, 2} = 4.302653 (tables).
  mean, half = plotting.t_interval(np.array([[1.0, 5.0], [2.0, 5.0], [3.0, 5.0]]))
  np.testing.assert_allclose(mean, [2.0, 5.0])
  np.testing.assert_allclose(half, [4.302653 / np.sqrt(3), 0.0], rtol=1e-6)
  # Two runs (0, 1): s = 0.7071, t_{0.975, 1} = 12.7062.
  _, half = plotting.t_interval(np.array([[0.0], [1.0]]))
  np.testing.assert_allclose(half, [12.7062 * 0.70711 / np.sqrt(2)], rtol=1e-4)
  assert np.isnan(plotting.t_interval(np.array([[0.5]]))[1][0])


def test_plot_t95_band(tmp_path):
  runs = [_fake_run(tmp_path, f"single_seed{i}", 6, 0.1 * (i + 1)) for i in range(2)]
  out = plotting.plot_curves(runs, ["eval/accuracy"], str(tmp_path / "t.png"), group_by="_seed",
                             band="t95")
  with open(out, "rb") as f:
    assert f.read(4) == b"\x89PNG"
  with pytest.raises(ValueError, match="band="):
    plotting.plot_curves(runs, ["eval/accuracy"], str(tmp_path / "x.png"), group_by="_seed",
                         band="sd")


class _FakeDevice:

  def __init__(self, stats):
    self._stats = stats

  def memory_stats(self):
    return self._stats


def test_device_memory_reports_the_fullest_device(monkeypatch):
  gb = 10**9
  devices = [_FakeDevice({"peak_bytes_in_use": 3 * gb, "bytes_limit": 80 * gb}),
             _FakeDevice({"peak_bytes_in_use": 7 * gb, "bytes_limit": 78 * gb}),
             _FakeDevice({"bytes_in_use": 9 * gb})]  # No peak: not counted.
  monkeypatch.setattr(jax, "local_devices", lambda: devices)
  assert metrics.device_memory() == {"mem/peak_gb": 7.0, "mem/limit_gb": 78.0}
  monkeypatch.setattr(jax, "local_devices", lambda: [_FakeDevice(None)])  # CPU: no stats.
  assert metrics.device_memory() == {}


def test_stable_drops_what_differs_between_identical_runs():
  rec = {"step": 1, "main/loss": 0.5, "time/step_s": 2.0, "tokens_per_s": 9.0, "mem/peak_gb": 3}
  assert metrics.stable([rec]) == [{"step": 1, "main/loss": 0.5}]
