"""The `model` section the worker tests build their Megatron roles with (the workers take it whole)."""

from megarl.config.sections import ModelConfig

FLOAT32_LOCAL = ModelConfig(dtype="float32", transformer_impl="local")
"""float32 (log-probs and updates compared exactly, or to float rounding, against HF and across layouts) with
megatron's local layer spec (runs on CPU; padded micro-batches); the schema's defaults are bfloat16 and auto."""
