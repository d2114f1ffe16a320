"""megarl's config: typed sections, YAML recipes with overrides, validation and the batch plan.

    from megarl.config.batch_plan import plan_batches  # BatchPlan
    from megarl.config.loader import load_config  # raises ConfigError
    from megarl.config.validate import validate  # list[Problem]

    config = load_config("configs/quickstart.yaml", ["actor.optim.lr=1e-5"])

Defaults live only in the dataclasses; a recipe states what differs. Nothing here rewrites a
setting: derived sizes live in the `BatchPlan`.

This package's `__init__` re-exports nothing: Python runs it before any submodule, so the schema
(`sections`, `roles`, `rollout`, `config`, `problems`) loads without the checks, which import the model
registry, tools and checkpoints (issue 30; `tests/unit/config/test_schema_imports.py` guards it).
Import each name from the module that defines it.
"""
