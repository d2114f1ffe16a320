"""megarl: Megatron-first reinforcement-learning post-training for LLMs."""

from megarl.versions import MEGARL as __version__

__all__ = ["__version__"]


def __getattr__(name: str):
    # `from megarl import Trainer` without importing torch/ray/vLLM on a plain `import megarl`.
    if name == "Trainer":
        from megarl.trainer.trainer import Trainer

        return Trainer
    if name == "SftTrainer":
        from megarl.trainer.sft import SftTrainer

        return SftTrainer
    raise AttributeError(f"module 'megarl' has no attribute {name!r}")
