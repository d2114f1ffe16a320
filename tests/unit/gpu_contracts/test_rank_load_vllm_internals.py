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


def test_the_fused_moe_internals_the_expert_load_relies_on_are_there():
    """A mixture of experts' rows go to `mlp.experts.routed_experts` (a `MoERunner` holding a `RoutedExperts`),
    indexed by its `expert_map` and counted by `local_num_experts`; after a reload the per-rank load redoes
    the kernel's own weight setup (`moe_kernel.fused_experts.process_weights_after_loading`), which vLLM's
    unquantized method runs on the first load only (`is_weight_update`). When vLLM lays this out otherwise
    (or runs the setup on reloads too), this fails by name."""
    import inspect

    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts
    from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod

    assert "self.routed_experts = routed_experts" in inspect.getsource(MoERunner.__init__)
    assert isinstance(RoutedExperts.expert_map, property)
    assert "self.local_num_experts =" in inspect.getsource(RoutedExperts)
    setup = inspect.getsource(UnquantizedFusedMoEMethod._setup_kernel)
    assert "if not is_weight_update:" in setup
    assert "self.moe_kernel.fused_experts.process_weights_after_loading(layer)" in setup
