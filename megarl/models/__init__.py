"""HF config -> megatron-core models, HF <-> Megatron weight layouts and checkpoints, tiny test models."""
