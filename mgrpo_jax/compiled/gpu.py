"""GPU targets to compile for without a GPU: XLA TargetConfigs and deviceless devices.

XLA:GPU's pipeline runs on a CPU-only machine with the `jax[cuda12]` wheels (no driver, no
autotuning) against a target config (`gpu_targets/<target>.txtpb`: XLA's TargetConfig text
proto) and a topology of such devices (`pip install -e ".[gpu]"`).
"""

import pathlib

TARGETS = ("h100_sxm", "h800", "h200")
TARGETS_DIR = pathlib.Path(__file__).parent / "gpu_targets"
GPUS_PER_NODE = 8
# Bytes per second one GPU receives over each link (the vendors' figures): NVLink within a
# node of 8 (H100/H200 SXM 900 GB/s, the H800 400 GB/s), InfiniBand between nodes (one
# 400 Gb/s NIC per GPU).
LINKS = {"h100_sxm": {"nvlink": 900e9, "infiniband": 50e9},
         "h800": {"nvlink": 400e9, "infiniband": 50e9},
         "h200": {"nvlink": 900e9, "infiniband": 50e9}}


def target_config(target: str) -> str:
  """The TargetConfig text of `target` (one of TARGETS)."""
  if target not in TARGETS:
    raise ValueError(f"GPU target {target!r} is not one of {TARGETS}")
  return (TARGETS_DIR / f"{target}.txtpb").read_text()


def memory_bytes(target: str) -> int:
  """One device's memory in bytes, as the target config states it."""
  return int(target_config(target).split("device_memory_size: ")[1].split()[0])


def devices(target: str, count: int):
  """`count` deviceless GPUs of `target`, in nodes of up to 8 ("1x1x<n>" or "1x<nodes>x8")."""
  from jax.experimental import topologies  # Registers nothing until called.
  topo = "1x1x%d" % count if count <= GPUS_PER_NODE else "1x%dx%d" % (
      count // GPUS_PER_NODE, GPUS_PER_NODE)
  return topologies.get_topology_desc(platform="cuda", target_config=target_config(target),
                                      topology=topo).devices
