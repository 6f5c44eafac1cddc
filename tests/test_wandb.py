"""Weights & Biases as a metric sink, run offline: the same curves as metrics.jsonl.

The offline run is read back from its own transaction log (`run-<id>.wandb`, the file
`wandb sync` uploads): wandb 0.31 ships no Python reader for it, so `read_offline_run`
parses its record framing (LevelDB's log format: 32 KiB blocks of CRC-checked chunks) and
the records with wandb's own protobuf classes.
"""

import glob
import json
import math
import os
import struct
import subprocess
import sys
import zlib

import pytest

from mgrpo_jax import config_checks, metrics
from configs import magrpo as magrpo_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_BLOCK, _HEADER = 32768, 7  # Block size; file header and chunk header lengths.
_FULL, _LAST = 1, 4  # Chunk types that end a record.


def _offline_env(monkeypatch, tmp_path):
  monkeypatch.setenv("WANDB_MODE", "offline")
  monkeypatch.setenv("WANDB_SILENT", "true")
  monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb_config"))
  monkeypatch.setenv("WANDB_CACHE_DIR", str(tmp_path / "wandb_cache"))


def _records(path: str):
  """The protobuf records of a `.wandb` file, each checked against its chunks' CRCs."""
  from wandb.proto import wandb_internal_pb2 as pb

  with open(path, "rb") as f:
    data = f.read()
  assert data[:4] == b":W&B", data[:7]
  pos, parts, out = _HEADER, [], []
  while pos + _HEADER <= len(data):
    if _BLOCK - pos % _BLOCK < _HEADER:  # A block's tail too short for a header is padding.
      pos += _BLOCK - pos % _BLOCK
      continue
    crc, n, kind = struct.unpack("<IHB", data[pos:pos + _HEADER])
    chunk = data[pos + _HEADER:pos + _HEADER + n]
    pos += _HEADER + n
    if kind == 0 and n == 0:
      continue
    assert zlib.crc32(chunk, zlib.crc32(bytes([kind]))) & 0xFFFFFFFF == crc
    parts.append(chunk)
    if kind in (_FULL, _LAST):
      record = pb.Record()
      record.ParseFromString(b"".join(parts))
      out.append(record)
      parts = []
  return out


def read_offline_run(run_dir: str) -> dict:
  """{"id", "project", "name", "config", "history": [{"step", key: value}]} of one offline
  run directory (`<dir>/wandb/offline-run-*`)."""
  (path,) = glob.glob(os.path.join(run_dir, "run-*.wandb"))
  out = {"history": [], "config": {}}
  for r in _records(path):
    kind = r.WhichOneof("record_type")
    if kind == "run":
      out.update(id=r.run.run_id, project=r.run.project, name=r.run.display_name)
      out["config"].update({i.key: json.loads(i.value_json) for i in r.run.config.update})
    elif kind == "config":
      out["config"].update({i.key: json.loads(i.value_json) for i in r.config.update})
    elif kind == "history":
      row = {(i.key or "/".join(i.nested_key)): json.loads(i.value_json)
             for i in r.history.item}
      row = {k: _nonfinite(v) for k, v in row.items()
             if k not in ("_runtime", "_timestamp")}
      row["step"] = row.pop("_step")
      out["history"].append(row)
  return out


def _nonfinite(v):
  return {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}.get(v, v)


def _offline_runs(workdir) -> list[dict]:
  """Every offline run under `workdir`, oldest first."""
  import wandb

  # wandb-core writes the run's log behind `finish()`; a teardown waits until it is written
  # (a process that ends waits too).
  wandb.teardown()
  dirs = sorted(glob.glob(os.path.join(str(workdir), "wandb", "offline-run-*")))
  return [read_offline_run(d) for d in dirs]


def _numeric(records: list[dict]) -> list[dict]:
  """The scalars of metrics.jsonl records, as the W&B sink logs them."""
  return [{k: float(v) for k, v in r.items()
           if k == "step" or (isinstance(v, (bool, int, float)))} for r in records]


def _same(a: list[dict], b: list[dict]):
  assert [sorted(r) for r in a] == [sorted(r) for r in b]
  for ra, rb in zip(a, b):
    for k in ra:
      assert ra[k] == rb[k] or (math.isnan(ra[k]) and math.isnan(rb[k])), (k, ra[k], rb[k])


def _write_config(workdir, **fields):
  os.makedirs(workdir, exist_ok=True)
  with open(os.path.join(workdir, "config.json"), "w") as f:
    json.dump(fields, f)


def test_offline_run_holds_the_jsonl_metrics_and_a_resume_continues_it(tmp_path, monkeypatch):
  pytest.importorskip("wandb")
  _offline_env(monkeypatch, tmp_path)
  workdir = tmp_path / "run"
  config = dict(seed=3, log_to="jsonl,tensorboard,wandb",
                wandb=dict(project="proj", name="first", entity=""))
  _write_config(workdir, **config)
  with metrics.open_writer(str(workdir)) as w:
    w.write(0, {"eval": {"accuracy": 0.25}, "name": "not a scalar", "hist": [1.0, 2.0]})
    w.write(1, {"main": {"reward": 0.5}, "loss": float("nan"), "up": math.inf, "ok": True})
    w.write(2, {"main": {"reward": 0.75}, "loss": 1.5})
  (first,) = _offline_runs(workdir)
  assert first["project"] == "proj" and first["name"] == "first"
  assert first["config"]["seed"] == 3 and first["config"]["wandb"]["project"] == "proj"
  records = metrics.read_metrics(str(workdir))
  _same(first["history"], _numeric(records))
  run_id = json.loads((workdir / metrics.WANDB_RUN_FILE).read_text())["id"]
  assert first["id"] == run_id

  # A crash after step 2's write; the resume from the checkpoint of step 2 redoes step 2.
  with metrics.open_writer(str(workdir)) as w:
    w.truncate_after(1)
    w.write(2, {"main": {"reward": 0.75}, "loss": 1.5})
    w.write(3, {"main": {"reward": 1.0}, "loss": 0.5})
  runs = _offline_runs(workdir)
  assert len(runs) == 2 and runs[1]["id"] == run_id  # The same W&B run, continued.
  records = metrics.read_metrics(str(workdir))
  assert [r["step"] for r in records] == [0, 1, 2, 3]
  # Offline, the resumed process starts at W&B step 0, so it logs the redone step 2 again;
  # online W&B starts after the run's last step and keeps the first step 2.
  _same(runs[1]["history"], _numeric(records[2:]))


def test_sinks_default_and_checks(tmp_path):
  c = magrpo_config.get_config("smoke")
  assert c.log_to == metrics.DEFAULT_LOG_TO == "jsonl,tensorboard"
  config_checks.check_log_to(c)
  c.unlock()
  for bad, match in (("jsonl,wandbx", "unknown sink"), ("tensorboard", "must include 'jsonl'")):
    c.log_to = bad
    with pytest.raises(config_checks.ConfigValueError, match=match):
      config_checks.check_log_to(c)
  assert metrics.parse_log_to(" jsonl , wandb,jsonl") == ("jsonl", "wandb")
  # A workdir whose config predates `log_to` (or has none) writes what it always did.
  _write_config(tmp_path, seed=0)
  with metrics.open_writer(str(tmp_path)) as w:
    w.write(0, {"x": 1.0})
  assert os.listdir(tmp_path / "tb") and not (tmp_path / "wandb").exists()
  assert not (tmp_path / metrics.WANDB_RUN_FILE).exists()


def test_a_run_without_wandb_never_imports_it(tmp_path):
  code = ("import sys; from mgrpo_jax import metrics, loop, config_checks; "
          f"w = metrics.open_writer({str(tmp_path)!r}); w.write(0, {{'x': 1.0}}); w.close(); "
          "assert 'wandb' not in sys.modules, 'imported'")
  subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=300)


def test_train_py_logs_to_offline_wandb(tmp_path, one_device_env):
  """The whole path: --config.log_to and --config.wandb.* on the command line, the run's
  config and every step's scalars in the offline run."""
  pytest.importorskip("wandb")
  workdir = tmp_path / "run"
  env = one_device_env(dict(os.environ, WANDB_MODE="offline", WANDB_SILENT="true",
                            WANDB_CONFIG_DIR=str(tmp_path / "cfg"),
                            WANDB_CACHE_DIR=str(tmp_path / "cache")))
  out = subprocess.run([sys.executable, "launch/train.py", "--config=configs/magrpo.py:smoke",
                        "--config.log_to=jsonl,wandb", "--config.wandb.project=smoke",
                        "--config.wandb.name=magrpo-smoke", f"--workdir={workdir}"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
  assert out.returncode == 0, out.stderr[-3000:]
  (run,) = _offline_runs(workdir)
  assert run["project"] == "smoke" and run["name"] == "magrpo-smoke"
  assert run["config"]["program"] == "magrpo" and run["config"]["log_to"] == "jsonl,wandb"
  records = metrics.read_metrics(str(workdir))
  assert len(records) >= 3 and not (workdir / "tb").exists()
  _same(run["history"], _numeric(records))
