"""Process groups, seeding, and the CPU runtime that lets megatron-core run on gloo.

`cpu_runtime` is the only place in megarl that knows "there is no CUDA device".
"""
