"""HF safetensors ⇄ a rank's Megatron `GPTModel` shards (any TP × PP; DP ranks hold copies).

Loading: every rank reads only the slices of the tensors its own shards need (safetensors
`get_slice`), checked against config.json. Exporting: TP shards are gathered onto TP rank 0 of each
stage, merged into HF tensors, and each stage writes its own safetensors file into a temp dir that
becomes `out_dir` atomically once every stage has written (rename after a barrier).

    groups = initialize_model_parallel(tp=2, pp=2, seed=0)
    model = build_gpt_model(hf_dir, groups)
    load_hf_weights(model, hf_dir, groups)
    ...
    export_hf_weights(model, "/out/step_100_hf", groups, hf_assets_dir=hf_dir)
"""

from __future__ import annotations

import shutil
import uuid
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core.utils import unwrap_model

from megarl.models.architectures import ValueHead
from megarl.models.hf_checkpoint import (
    SINGLE_FILE,
    HFCheckpoint,
    copy_hf_assets,
    write_index,
    write_safetensors_shard,
)
from megarl.models.hf_config import ModelDims, read_model_dims
from megarl.models.layout import (
    VOCAB_DIVISIBLE_BY,
    expert_offset,
    hf_param_shapes,
    is_expert,
    layer_offset,
    merge_tp_shards,
    param_mapping,
    tp_shard_from_hf,
)
from megarl.parallel.distributed import ProcessGroups


def load_hf_weights(
    model: torch.nn.Module,
    hf_dir: str | Path,
    groups: ProcessGroups,
    *,
    vocab_divisible_by: int = VOCAB_DIVISIBLE_BY,
) -> None:
    """Copy an HF checkpoint's weights into this rank's shards of `model` (a GPTModel, possibly
    wrapped in DDP / Float16Module; with virtual stages one chunk, whose `vp_stage` places its layers).
    A critic's `ValueHead` keeps its init (HF has no value head).

    Raises ValueError naming the file and tensor on a shape mismatch, KeyError on a missing tensor,
    FileNotFoundError on a missing shard file.
    """
    model = unwrap_model(model)
    dims = read_model_dims(hf_dir)
    checkpoint = HFCheckpoint(hf_dir)
    expected = hf_param_shapes(dims)
    offset = chunk_layer_offset(model, dims.num_layers, groups)
    experts = expert_offset(dims, groups.ep_size, groups.ep_rank)
    value_head = "output_layer.weight" if isinstance(getattr(model, "output_layer", None), ValueHead) else None
    params = _named_weights(model)
    with checkpoint.reader() as read, torch.no_grad():
        for name, param in params.items():
            if name == value_head:
                continue
            mapping = param_mapping(name, dims, layer_offset=offset, expert_offset=experts)
            for hf_name in mapping.hf_names:
                checkpoint.require(hf_name, expected[hf_name])
            # An expert is cut over the expert-TP ranks, everything else over the TP ranks.
            tp_size, tp_rank = (
                (groups.etp_size, groups.etp_rank) if is_expert(name) else (groups.tp_size, groups.tp_rank)
            )
            shard = tp_shard_from_hf(
                mapping, read, dims, tp_size=tp_size, tp_rank=tp_rank, vocab_divisible_by=vocab_divisible_by
            )
            if shard.shape != param.shape:
                raise ValueError(
                    f"{checkpoint.dir}: {mapping.hf_names} give a shard of shape {list(shard.shape)} for Megatron "
                    f"{name} of shape {list(param.shape)} (vocab_divisible_by={vocab_divisible_by}, TP={tp_size})"
                )
            param.copy_(shard)


def chunk_layer_offset(chunk: torch.nn.Module, num_layers: int, groups: ProcessGroups) -> int:
    """Global index of the first layer of `chunk` (an unwrapped GPTModel of this rank; its `vp_stage` is
    None without virtual stages)."""
    return layer_offset(num_layers, groups.pp_size, groups.pp_rank, groups.vpp_size, chunk.vp_stage or 0)


def export_hf_weights(
    model: torch.nn.Module | list[torch.nn.Module],
    out_dir: str | Path,
    groups: ProcessGroups,
    *,
    hf_assets_dir: str | Path,
) -> Path | None:
    """Write the model as an HF checkpoint dir (safetensors + the non-weight files of `hf_assets_dir`:
    config.json, tokenizer, generation config). Call on every rank; DP replicas other than DP rank 0
    return None at once. PP = 1 writes `model.safetensors`, PP > 1 one file per stage plus an index.

    `out_dir` appears complete or not at all (an existing one is replaced). Returns it on the ranks
    that wrote. The model must be an LM (a critic's value head has no HF form). With virtual stages pass
    this rank's chunks (a list): its file holds the layers of all of them. The experts come from the
    first expert-DP replica (its ETP × EP ranks), which shares its first rank, the writer of each stage,
    with DP rank 0 (megatron's dense and expert grids both start a stage at its first rank).
    """
    if groups.cp_rank != 0:  # a CP rank holds its DP replica's weights (`ProcessGroups.weight_replicas`)
        return None
    if groups.dp_rank != 0 and groups.expert_dp_rank != 0:
        return None
    chunks = [unwrap_model(chunk) for chunk in (model if isinstance(model, list) else [model])]
    if any(isinstance(getattr(chunk, "output_layer", None), ValueHead) for chunk in chunks):
        raise ValueError("export_hf_weights: a critic (value_head=True) has no HF checkpoint form")
    dims = read_model_dims(Path(hf_assets_dir))
    out_dir = Path(out_dir)
    tensors = {
        name: tensor for chunk in chunks for name, tensor in _gather_stage_hf_tensors(chunk, dims, groups).items()
    }
    if groups.dp_rank != 0:  # a rank of the first expert-DP replica: its experts are on the writer now
        return None
    tmp_dir = _shared_tmp_dir(out_dir, groups)
    file_name = (
        SINGLE_FILE if groups.pp_size == 1 else f"model-{groups.pp_rank + 1:05d}-of-{groups.pp_size:05d}.safetensors"
    )
    if groups.tp_rank == 0:
        write_safetensors_shard(tensors, tmp_dir / file_name)
    stage_maps = [None] * groups.pp_size
    summary = (dict.fromkeys(tensors, file_name), sum(t.numel() * t.element_size() for t in tensors.values()))
    dist.all_gather_object(stage_maps, summary, group=groups.pp)
    dist.barrier(group=groups.mp)
    if groups.tp_rank == 0 and groups.pp_rank == 0:
        if groups.pp_size > 1:
            weight_map = {name: file for names, _ in stage_maps for name, file in names.items()}
            write_index(tmp_dir, weight_map, sum(size for _, size in stage_maps))
        copy_hf_assets(Path(hf_assets_dir), tmp_dir)
        _replace_dir(tmp_dir, out_dir)
    dist.barrier(group=groups.mp)
    return out_dir


def _named_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """State-dict tensors that are weights (TE keeps `_extra_state` entries beside them)."""
    return {name: t for name, t in model.state_dict(keep_vars=True).items() if not name.endswith("_extra_state")}


def _gather_stage_hf_tensors(model: torch.nn.Module, dims: ModelDims, groups: ProcessGroups) -> dict[str, torch.Tensor]:
    """This chunk's parameters as HF tensors (host memory) on its stage's first rank (empty dict
    elsewhere): dense ones gathered over TP by DP rank 0's ranks, experts over expert-TP then EP by the
    first expert-DP replica's (EP rank r's local expert e is global expert r * E / EP + e)."""
    offset = chunk_layer_offset(model, dims.num_layers, groups)
    hf_tensors: dict[str, torch.Tensor] = {}
    for name, param in _named_weights(model).items():
        if name == "output_layer.weight" and dims.tie_word_embeddings:
            continue  # a copy of the first stage's embedding, exported from there
        param_mapping(name, dims, layer_offset=offset)  # on every rank: fail before the collective
        shard = param.detach().contiguous()
        if is_expert(name):
            gathered = _gather_expert(name, shard, dims, offset, groups) if groups.expert_dp_rank == 0 else []
        elif groups.dp_rank == 0:
            mapping = param_mapping(name, dims, layer_offset=offset)
            gathered = _gather_tp(mapping, shard, dims, groups.tp, groups.tp_size, groups.tp_rank)
        else:
            gathered = []
        # Host memory: a whole stage would not fit beside the model on the accelerator.
        hf_tensors.update((hf_name, tensor.cpu()) for hf_name, tensor in gathered)
    return hf_tensors


def _gather_tp(
    mapping, shard: torch.Tensor, dims: ModelDims, group, size: int, rank: int
) -> list[tuple[str, torch.Tensor]]:
    """The HF tensors of one parameter from its shards over a TP (or expert-TP) `group`, on its rank
    0 (empty elsewhere); a collective of the group."""
    shards = [torch.empty_like(shard) for _ in range(size)] if rank == 0 else None
    dist.gather(shard, shards, dst=dist.get_global_rank(group, 0), group=group)
    return merge_tp_shards(mapping, shards, dims) if rank == 0 else []


def _gather_expert(name: str, shard: torch.Tensor, dims: ModelDims, offset: int, groups: ProcessGroups):
    """One local expert parameter of every EP rank as HF tensors on expert-TP rank 0 of EP rank 0:
    merged over expert TP, then gathered over EP among the expert-TP rank 0s (an EP group holds ranks
    of one expert-TP rank)."""
    experts = expert_offset(dims, groups.ep_size, groups.ep_rank)
    mapping = param_mapping(name, dims, layer_offset=offset, expert_offset=experts)
    merged = _gather_tp(mapping, shard, dims, groups.etp, groups.etp_size, groups.etp_rank)
    if groups.etp_rank != 0 or groups.ep_size == 1:
        return merged
    gathered = []
    for index, (_, tensor) in enumerate(merged):
        parts = [torch.empty_like(tensor) for _ in range(groups.ep_size)] if groups.ep_rank == 0 else None
        dist.gather(tensor.contiguous(), parts, dst=dist.get_global_rank(groups.ep, 0), group=groups.ep)
        if groups.ep_rank == 0:
            for ep_rank, part in enumerate(parts):
                names = param_mapping(
                    name, dims, layer_offset=offset, expert_offset=expert_offset(dims, groups.ep_size, ep_rank)
                ).hf_names
                gathered.append((names[index], part))
    return gathered


def _shared_tmp_dir(out_dir: Path, groups: ProcessGroups) -> Path:
    """A fresh sibling of out_dir, named by rank 0 of the model-parallel group, created by it."""
    name = [f".{out_dir.name}.tmp-{uuid.uuid4().hex[:8]}"]
    dist.broadcast_object_list(name, src=dist.get_global_rank(groups.mp, 0), group=groups.mp)
    tmp_dir = out_dir.parent / name[0]
    if dist.get_rank(groups.mp) == 0:
        tmp_dir.mkdir(parents=True)
    dist.barrier(group=groups.mp)
    return tmp_dir


def _replace_dir(tmp_dir: Path, out_dir: Path) -> None:
    """Rename tmp_dir to out_dir; an existing out_dir is moved aside first and deleted after."""
    old = out_dir.parent / f".{out_dir.name}.old-{uuid.uuid4().hex[:8]}"
    if out_dir.exists():
        out_dir.rename(old)
    tmp_dir.rename(out_dir)
    shutil.rmtree(old, ignore_errors=True)
