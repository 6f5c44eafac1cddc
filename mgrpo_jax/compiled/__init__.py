"""The real steps compiled from abstract inputs, and what the compiled programs do.

Nothing here runs a step: each case lowers the jitted update, decode or prefill that training
and sampling run with `jax.ShapeDtypeStruct` inputs, for this machine's devices or for a
deviceless GPU topology, so the memory, kernels and collectives of the real shapes (Qwen3
0.6B to 30B-A3B, traces of 32k tokens) can be read on a CPU:

- `cases`: the steps' case builders and their memory per device;
- `gpu`: the GPU targets (H100 SXM, H800, H200) and their deviceless devices;
- `hlo`: kernels, bytes written, custom calls and collectives read from optimized HLO.
"""
