"""The per-rank load (`megarl/workers/rollout/rank_load.py`) drives vLLM's private layerwise-reload
helpers (vllm/model_executor/model_loader/reload/{layerwise,meta,utils}.py, vLLM 0.32). They are the
same on CPU and GPU, and the CPU e2e tests run them; this test pins the call shapes so an upgrade of
vLLM that changes them fails here, by name, rather than deep inside a sync on a GPU cluster."""

import pytest

pytest.importorskip("vllm")

from call_sites import assert_fits, call_sites
from vllm.model_executor.model_loader.reload import layerwise, meta, utils

pytestmark = pytest.mark.unit

RANK_LOAD = "workers/rollout/rank_load.py"


@pytest.mark.parametrize(
    "module, name",
    [
        (layerwise, "get_layerwise_info"),
        (layerwise, "_copy_and_restore_kernel_tensors"),
        (meta, "materialize_layer"),
        (meta, "restore_layer_on_meta"),
        (utils, "get_layer_params_buffers"),
    ],
)
def test_every_call_fits_the_installed_helper(module, name):
    assert_fits(call_sites(RANK_LOAD, name), getattr(module, name), bound=False)
