"""The values `model.dtype` and `model.transformer_impl` may take. Apart from
`megarl.models.architectures`, which builds the models, so that the driver checks a recipe's model
settings without importing megatron-core."""

import torch

TRANSFORMER_IMPLS = ("local", "transformer_engine")
TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
"""`model.dtype` names the Megatron roles train in. float16 is not one: it needs a dynamic loss
scale driven by the training loop (megatron's `grad_scale_func`), which megarl does not run."""
