"""Every GPU measurement the open GPU issues ask for, in one device call of under 10 minutes.

A session lent a GPU gets 15 device-minutes, machine start included, and one command may run
10 minutes; this runs the checks in order of what they prove, each under its own time limit,
and writes each stage's log and a summary as it goes, so a stage that fails or runs out of
time still leaves the others' results. Prepare here, then run there:

  bash benchmarks/gpu_wheels.sh     # here: .whl/ (git-ignored) holds what the image lacks
  # device run, carry=[".whl"], timeout_s=600, command:
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \
    && PYTHONPATH=/tmp/site:$PWD python3 benchmarks/gpu_check.py
  python benchmarks/gpu_check.py --tiny --out=/work/scratch/check   # the same, tiny, any backend

Stages (--stages), in this order, each under its --limits_s (a stage without one, by
default the tests, takes what is left of --budget_s):
  smoke  versions and device, then `benchmarks/gpu.py --tiny` (sampler and update at tiny
         shapes): a broken install or an API change shows here, in under a minute, and
         stops the run.
  train  3 M-GRPO steps of `configs/mgrpo.py:gpu` (random Qwen3-0.6B, bf16 over f32 master
         weights, the paper's limits): step and rollout times, tokens, and the allocator's
         peak memory per step (`mem/peak_gb`).
  speed  `benchmarks/gpu.py`, its headline cases first, for 270 s (it starts no case in the
         last 90).
  tests  the tests whose numbers a GPU can change, on the GPU (the `gpu`-marked cuDNN test
         among them): tests/models, tests/rl, tests/test_sampling.py,
         tests/test_gpu_benchmark.py. Those that need several devices skip on one GPU.
         If the first call leaves them too little time, call again at once (the machine
         stays warm for 30 s): `... gpu_check.py --stages=tests --budget_s=240`.

Output (in --out, default $OUT on the device machine, else benchmarks/results/gpu-check):
gpu-check.json (every stage: command, exit code, seconds, and what it measured), one log per
stage, and gpu-<device>.json from the speed stage: at most 8 files, what a device call
returns. The parent process never imports JAX, so the stages get the whole GPU.
"""

import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET

from absl import app, flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STAGES = ("smoke", "train", "speed", "tests")
TEST_PATHS = ("tests/models", "tests/rl", "tests/test_sampling.py", "tests/test_gpu_benchmark.py")

_STAGES = flags.DEFINE_list("stages", list(STAGES), f"Stages to run, of {STAGES}.")
_BUDGET = flags.DEFINE_float("budget_s", 570.0, "Seconds for all stages together.")
_LIMITS = flags.DEFINE_list("limits_s", ["smoke=90", "train=240", "speed=270"],
                            "stage=seconds: time limits; a stage without one takes what is left.")
_TINY = flags.DEFINE_bool("tiny", False, "Tiny sizes on any backend: a dry run of the stages.")
_OUT = flags.DEFINE_string("out", "", "Output folder (default $OUT, else "
                           "benchmarks/results/gpu-check).")

# The smoke stage's first program: versions and the device, one JSON line after "SMOKE ".
_SMOKE = """
import importlib, json, jax
versions = {}
for name in ("jax", "jaxlib", "flax", "optax", "orbax.checkpoint", "chex", "tensorstore",
             "transformers", "ml_collections", "bm25s", "tensorboardX", "torch", "numpy"):
  try:
    versions[name] = getattr(importlib.import_module(name), "__version__", "?")
  except Exception as e:
    versions[name] = f"missing: {type(e).__name__}: {e}"
import mgrpo_jax
d = jax.devices()[0]
print("SMOKE " + json.dumps(dict(backend=jax.default_backend(), device=d.device_kind,
                                 devices=jax.device_count(), memory_stats=d.memory_stats() or {},
                                 versions=versions)), flush=True)
"""
# Its second: the sampler and the update step at tiny shapes, through benchmarks/gpu.py.
_SMOKE_TINY_CASES = ("--tiny --cases=decode,update --batches=2 --variant_batches=2 "
                     "--remat_policies=nothing")


def device_slug(kind: str) -> str:
  """'NVIDIA H100 80GB HBM3' -> 'nvidia-h100-80gb-hbm3' (benchmarks/gpu.py's file name)."""
  return re.sub(r"[^a-z0-9]+", "-", kind.lower()).strip("-")


def run_stage(name: str, cmd: list[str], out_dir: str, limit_s: float, env=None) -> dict:
  """Runs `cmd` from the repository root with its output in `out_dir/<name>.log`."""
  log = os.path.join(out_dir, f"{name}.log")
  t0 = time.perf_counter()
  with open(log, "w") as f:
    f.write("$ " + " ".join(cmd) + "\n")
    f.flush()
    try:
      rc = subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, timeout=limit_s,
                          env=dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))).returncode
    except subprocess.TimeoutExpired:
      rc = "timeout"
  with open(log) as f:
    tail = f.read()[-1500:]
  return dict(command=" ".join(cmd), rc=rc, seconds=round(time.perf_counter() - t0, 1),
              limit_s=round(limit_s), tail=tail)


def smoke_report(log: str) -> dict:
  """What the smoke stage's first program found: backend, device, versions."""
  with open(log) as f:
    found = [line[len("SMOKE "):] for line in f if line.startswith("SMOKE ")]
  return json.loads(found[-1]) if found else {}


def summarize_train(workdir: str) -> dict:
  """Per step: step and rollout seconds, tokens generated and trained, peak memory (GPU)."""
  from mgrpo_jax import metrics  # Imports JAX but starts no backend.
  path = os.path.join(workdir, metrics.METRICS_FILE)
  if not os.path.exists(path):
    return {"steps": []}
  keys = ("time/step_s", "time/rollout_s", "main/gen_tokens", "main/turns", "main/tokens",
          "sub/tokens", "sub/turns", "mem/peak_gb", "mem/limit_gb", "eval/gen_tokens")
  steps = [{"step": r["step"], **{k: r[k] for k in keys if k in r}}
           for r in metrics.read_metrics(workdir)]
  peaks = [s["mem/peak_gb"] for s in steps if "mem/peak_gb" in s]
  return {"steps": steps, "peak_gb": max(peaks) if peaks else None}


def summarize_tests(junit: str) -> dict:
  """Counts of a pytest JUnit file, and the names of what failed."""
  if not os.path.exists(junit):
    return {}
  root = ET.parse(junit).getroot()
  suite = root if root.tag == "testsuite" else root.find("testsuite")
  failed = [f"{c.get('classname')}::{c.get('name')}" for c in suite.iter("testcase")
            if c.find("failure") is not None or c.find("error") is not None]
  return dict(tests=int(suite.get("tests", 0)), failures=int(suite.get("failures", 0)),
              errors=int(suite.get("errors", 0)), skipped=int(suite.get("skipped", 0)),
              failed=failed)


def stage_commands(stage: str, out_dir: str, limit_s: float, tiny: bool, slug: str,
                   workdir: str):
  """(command, extra environment) of a stage; `workdir` is the train stage's."""
  py = sys.executable
  if stage == "smoke":
    script = f"{py} -c {shlex.quote(_SMOKE)} && {py} benchmarks/gpu.py {_SMOKE_TINY_CASES}"
    return ["bash", "-c", script], {}
  if stage == "train":
    arg = "gpu,model=tiny" if tiny else "gpu"
    return [py, "launch/train.py", f"--config=configs/mgrpo.py:{arg}", "--config.num_steps=3",
            "--config.eval_every=3", "--config.num_eval_questions=2",
            "--config.checkpoint_every=3", f"--workdir={workdir}"], {}
  if stage == "tests":
    junit = os.path.join(out_dir, "tests.xml")
    if os.path.exists(junit):
      os.remove(junit)  # An earlier run's: never summarised as this one's.
    paths = ["tests/models/test_attention.py"] if tiny else list(TEST_PATHS)
    env = {"XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
    if not tiny:
      env["JAX_PLATFORMS"] = "cuda"  # tests/conftest.py picks the CPU unless told otherwise.
    return [py, "-m", "pytest", "-q", "-n", "2" if tiny else "4", "-m", "not slow",
            "--junitxml", junit, *paths], env
  if stage == "speed":
    # gpu.py starts no case after its budget; the last may take a minute more.
    budget = max(limit_s - 90, 0)
    extra = ["--tiny"] if tiny else []
    return [py, "benchmarks/gpu.py", *extra, f"--budget_s={budget:.0f}",
            f"--out={os.path.join(out_dir, f'gpu-{slug}.json')}"], {}
  raise ValueError(f"--stages: unknown stage {stage!r}; expected some of {STAGES}.")


def parse_limits(items: list[str]) -> dict[str, float]:
  """["smoke=90", "train=180"] -> {"smoke": 90.0, "train": 180.0}, naming a bad item."""
  limits = {}
  for item in items:
    name, _, seconds = item.partition("=")
    try:
      limits[name] = float(seconds)
    except ValueError:
      limits[name] = -1.0
    if name not in STAGES or limits[name] <= 0:
      raise app.UsageError(f"--limits_s: {item!r}; expected stage=seconds with a stage of "
                           f"{STAGES} and seconds > 0.")
  return limits


def _write(path: str, summary: dict) -> None:
  with open(path, "w") as f:
    json.dump(summary, f, indent=1)


def main(argv):
  del argv
  stages = list(_STAGES.value)
  unknown = [s for s in stages if s not in STAGES]
  if unknown:
    raise app.UsageError(f"--stages: unknown {unknown}; expected some of {STAGES}.")
  limits = parse_limits(_LIMITS.value)
  out_dir = _OUT.value or os.environ.get("OUT") or os.path.join(ROOT, "benchmarks", "results",
                                                                 "gpu-check")
  os.makedirs(out_dir, exist_ok=True)
  summary_path = os.path.join(out_dir, "gpu-check.json")
  summary = dict(command="python benchmarks/gpu_check.py " + " ".join(sys.argv[1:]),
                 tiny=_TINY.value, stages={})
  t0, slug = time.perf_counter(), "unknown"
  # Outside --out: only the stages' summaries and logs go back from a device call.
  workdir = tempfile.mkdtemp(prefix="gpu-check-train-")
  for stage in stages:
    left = _BUDGET.value - (time.perf_counter() - t0)
    if left < 20:
      summary["stages"][stage] = {"skipped": f"--budget_s={_BUDGET.value:g} spent"}
      _write(summary_path, summary)
      continue
    limit = min(limits.get(stage, left), left - 10)
    cmd, env = stage_commands(stage, out_dir, limit, _TINY.value, slug, workdir)
    print(f"[{time.perf_counter() - t0:5.0f} s] {stage} (limit {limit:.0f} s) ...", flush=True)
    r = run_stage(stage, cmd, out_dir, limit, env)
    if stage == "smoke":
      r.update(smoke_report(os.path.join(out_dir, "smoke.log")))
      slug = device_slug(r.get("device", slug))
      summary["device"] = r.get("device")
    elif stage == "train":
      r.update(summarize_train(workdir))
    elif stage == "tests":
      r.update(summarize_tests(os.path.join(out_dir, "tests.xml")))
    summary["stages"][stage] = r
    summary["elapsed_s"] = round(time.perf_counter() - t0, 1)
    print(f"        rc={r['rc']} in {r['seconds']} s", flush=True)
    _write(summary_path, summary)
    if stage == "smoke" and r["rc"] != 0:
      print("The smoke stage failed; nothing else would run. Its log:\n" + r["tail"])
      break
  print(f"-> {summary_path}")


if __name__ == "__main__":
  app.run(main)
