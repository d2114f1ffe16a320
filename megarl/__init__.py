"""megarl: Megatron-first reinforcement-learning post-training for LLMs."""

__version__ = "0.1.0"


def __getattr__(name: str):
    # `from megarl import Trainer` without importing torch/ray/vLLM on a plain `import megarl`.
    if name == "Trainer":
        from megarl.trainer.trainer import Trainer

        return Trainer
    if name == "SftTrainer":
        from megarl.trainer.sft import SftTrainer

        return SftTrainer
    raise AttributeError(f"module 'megarl' has no attribute {name!r}")
