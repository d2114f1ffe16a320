"""The exact sync check: a position-weighted checksum of every HF tensor, computed on both sides
from independent sources and compared name by name.

- Engine side: each rollout worker checksums every tensor as its loader receives it, before vLLM
  processes (repacks) it, cast to the engine's dtype (what vLLM's `copy_` into its parameters does):
  a full HF tensor as it is, one of the per-rank sync's tensors (vLLM's per-rank layout: `qkv_proj`
  rank r is [q_r; k_r; v_r], `gate_up_proj` [gate_r; up_r], `o_proj`/`down_proj` a block of
  columns) as the partial checksums of the HF tensors its rows belong to (`LoadedChecksums`).
- Trainer side: every rank of DP replica 0 checksums its own live Megatron shards, cast to the same
  dtype, as partial checksums of the HF tensors. Which HF rows and columns a shard holds comes from
  the checkpoint loader's slicing (`layout.tp_shard_from_hf`, run on row numbers instead of data),
  not from the sync's conversion, so a wrong mapping on the sending side (gate/up halves swapped, a
  qkv regroup off by a head) is caught as well as a lost or misplaced bucket, a missing tensor or a
  wrong cast on the way.

The checksum of a tensor x viewed as the integers of its bits in `dtype`, as rows r (dim 0) and
columns c (the flattened trailing dims; a 1-D tensor is a column), is `Σ_{r,c} u(r) · v(c) · bits[r, c]
mod 2^32`, with u and v two 32-bit integer hashes of the index (`row_weights`, `column_weights`):
exact and order-free (integer sums), position-sensitive (a swap, shift or transpose changes it), and
additive over elements, so the partial checksums of a tensor's row blocks or column blocks, each
weighted at its own HF rows and columns, add up to the whole tensor's (`block_checksum`). The weights
are hashes, not affine in the index, because affine weights cancel over power-of-two sizes: with the
weight 2i + 1 of flat index i, Σ_{i<n} (2i + 1) = n², which is 0 mod 2^32 for any tensor of a multiple of
2^16 elements, so an error that moves every element's bits by the same amount (every bf16 value doubled,
a wrong exponent) went unseen in most real weight matrices. Separable weights cost one int32 multiply
and add per element, as the affine ones did. This is the idea of slime's weight-equality check
(compare the engine's weights with an independent copy after an update), at the cost of one integer
pass over the weights on each side.

    parts = [rank_checksums(plan, actor.named_parameters_for_sync(), groups, "bfloat16")]   # every trainer rank
    loaded = engine.loaded_checksums()              # one `LoadedChecksums` per worker of one engine
    check_checksums(combine(parts), loaded, dtype="bfloat16", layout=plan.layout, engine="rollout engine 0")
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from megarl.bridge.collect import holds_shard, local_params_by_plan_name, shard_group
from megarl.bridge.plan import LayoutPair, PlannedParam, SyncPlan
from megarl.bridge.schedule import vllm_vocab_rows
from megarl.bridge.verify import SyncVerificationError
from megarl.models.hf_config import ModelDims
from megarl.models.layout import REPLICATED, VOCAB, ParamMapping, tp_shard_from_hf

MOD = 1 << 32
"""Checksums are taken mod 2^32: a wrong tensor goes unnoticed with odds of 2^-32."""
CHUNK_ELEMENTS = 1 << 24
"""Elements widened at once (bounds the temporary memory of a checksum: 64 MiB in int32)."""
_MASK = MOD - 1
_HASH_MULTIPLIER = 0x45D9F3B
"""An odd multiplier of a known-good 32-bit integer hash (xor-shift-multiply)."""
_INT_OF_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
SHOWN = 8
"""Tensors named in a checksum error (the rest are counted)."""


class WeightChecksumError(SyncVerificationError):
    """A rollout engine loaded tensors whose bits differ from the actor's, or missed / added some."""


@dataclass
class LoadedChecksums:
    """What one rollout worker loaded in its last sync, by HF name."""

    dtype: str
    """The engine's dtype the tensors were checksummed in (e.g. "bfloat16")."""
    full: dict[str, int] = field(default_factory=dict)
    """Checksums of the whole HF tensors this worker received."""
    partial: dict[str, int] = field(default_factory=dict)
    """Partial checksums of the HF tensors this worker received a TP block of (per-rank sync): summed
    over the engine's workers, they give the whole tensor's."""


def index_hash(index: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash of int64 indices (any shape, >= 0): xor-shift-multiply rounds, the
    multiplier below 2^27 so every product fits in int64. int64 in [0, 2^32)."""
    x = (index ^ (index >> 32)) & _MASK
    for _ in range(2):
        x = (((x >> 16) ^ x) * _HASH_MULTIPLIER) & _MASK
    return (x >> 16) ^ x


def row_weights(rows: torch.Tensor) -> torch.Tensor:
    """u(r) of HF rows `rows`: odd int64 below 2^31 (so u · a 32-bit value fits in int64). Odd weights make
    u·v odd, so a change of any single element (by d ≠ 0 mod 2^32) always changes the checksum."""
    return (index_hash(2 * rows) >> 1) | 1


def column_weights(columns: torch.Tensor) -> torch.Tensor:
    """v(c) of HF columns `columns`, a hash other than the rows' (w(r, c) ≠ w(c, r): a transposed square
    matrix changes the checksum): odd, int32 (the 32 bits of the hash), for products that wrap mod 2^32."""
    x = index_hash(2 * columns + 1) | 1  # odd, as the rows'
    return (x - ((x >> 31) << 32)).to(torch.int32)


def block_checksum(block: torch.Tensor, dtype: torch.dtype, hf_rows: torch.Tensor, first_column: int = 0) -> int:
    """The share of an HF tensor's checksum carried by `block` cast to `dtype`: row j of the block
    (dim 0; a 1-D block's elements are rows of one column) is HF row `hf_rows[j]`, its columns
    (flattened trailing dims) are HF columns `first_column`, `first_column + 1`, ... One int32
    multiply and add per element, as a plain weighted sum would be: the column weights multiply in
    int32 (the products wrap mod 2^32), each row's sum is reduced mod 2^32 and weighted by its row's."""
    ints = block.detach().to(dtype).view(_INT_OF_WIDTH[dtype.itemsize])
    ints = ints.flatten(1) if ints.dim() > 1 else ints.reshape(-1, 1)  # [rows, columns], even with no rows
    columns = torch.arange(ints.shape[1], dtype=torch.int64, device=ints.device) + first_column
    v = column_weights(columns)
    u = row_weights(hf_rows.to(device=ints.device, dtype=torch.int64))
    total = 0
    step = max(1, CHUNK_ELEMENTS // max(ints.shape[1], 1))
    for start in range(0, ints.shape[0], step):
        rows = _as_int32(ints[start : start + step])
        sums = (rows * v).sum(1, dtype=torch.int64) & _MASK  # Σ_c v(c)·bits mod 2^32 per row, < 2^32
        total += int(((sums * u[start : start + step]) & _MASK).sum())  # < 2^63 each, < 2^32 after the mask
    return total % MOD


def _as_int32(ints: torch.Tensor) -> torch.Tensor:
    """Integer bits of up to 8 bytes as int32, mod 2^32 (narrower ones sign-extend, alike on both sides)."""
    if ints.element_size() <= 4:
        return ints.to(torch.int32)
    low = ints & _MASK
    return (low - ((low >> 31) << 32)).to(torch.int32)


def tensor_checksum(tensor: torch.Tensor, dtype: torch.dtype) -> int:
    """`Σ_{r,c} u(r) · v(c) · bits[r, c] mod 2^32` over `tensor` cast to `dtype` (module docstring)."""
    rows = tensor.shape[0] if tensor.dim() else 1
    return block_checksum(tensor, dtype, torch.arange(rows))


def combine(parts: Iterable[Mapping[str, int]]) -> dict[str, int]:
    """Partial checksums summed per name (mod 2^32)."""
    total: dict[str, int] = {}
    for part in parts:
        add_into(total, part)
    return total


def add_into(total: dict[str, int], part: Mapping[str, int]) -> None:
    """`part`'s partial checksums added to `total`'s, in place."""
    for name, value in part.items():
        total[name] = (total.get(name, 0) + value) % MOD


# --- trainer side: the actor's shards, placed by the checkpoint loader's slicing -----------------


def rank_checksums(
    plan: SyncPlan, named_parameters: Iterable[tuple[str, torch.Tensor]], groups, dtype: str
) -> dict[str, int]:
    """`actor_checksums` of this trainer rank's live parameters (`MegatronActor.named_parameters_for_sync`)
    in its place of `groups` (`ProcessGroups`), checksummed in `dtype` (the engines' dtype name)."""
    local = local_params_by_plan_name(plan, named_parameters, groups)
    return actor_checksums(plan, local, groups, dtype=getattr(torch, dtype))


def actor_checksums(plan: SyncPlan, local: Mapping[str, torch.Tensor], groups, *, dtype: torch.dtype) -> dict[str, int]:
    """This trainer rank's partial checksums of the HF tensors of `plan` (`local`: its shards by plan
    name, `collect.local_params_by_plan_name`; `groups`: its place in the grid, `ProcessGroups`), of
    the copies the sync sends (`collect.holds_shard`: DP replica 0's; an expert's, its EP rank's in
    the first expert-DP replica). `combine` over the ranks gives the checksum of every HF tensor the
    engines must hold."""
    parts = []
    for param in plan.params:
        if holds_shard(param, plan, groups):
            cut = shard_group(param, groups)
            parts.append(
                shard_checksums(
                    param, local[param.megatron_name], plan.dims, tp_size=cut.size, tp_rank=cut.rank, dtype=dtype
                )
            )
    return combine(parts)


def shard_checksums(
    param: PlannedParam, shard: torch.Tensor, dims: ModelDims, *, tp_size: int, tp_rank: int, dtype: torch.dtype
) -> dict[str, int]:
    """TP rank `tp_rank`'s partial checksums of `param`'s HF tensors from its Megatron `shard` (a
    replicated parameter: TP rank 0's whole copy, nothing from the others)."""
    if param.kind == REPLICATED and tp_rank > 0:
        return {}
    # Rows per rank as the divisor makes the loader pad the vocabulary exactly as this shard is padded.
    divisible_by = shard.shape[0] if param.kind == VOCAB else 1
    origin, first_columns = loader_rows(param, dims, tp_size, tp_rank, divisible_by)
    if origin.shape[0] != shard.shape[0]:
        raise ValueError(
            f"{param.megatron_name}: shard of {shard.shape[0]} rows, the loader's slicing gives "
            f"{origin.shape[0]} at TP {tp_size}"
        )
    checksums = {}
    for index, name in enumerate(param.hf_names):
        rows = origin[:, 0] == index + 1  # on the CPU, like `origin`; the shard may be on a GPU
        checksums[name] = block_checksum(
            shard[rows.to(shard.device)], dtype, origin[rows, 1], first_columns.get(index, 0)
        )
    return checksums


def loader_rows(
    param: PlannedParam, dims: ModelDims, tp_size: int, tp_rank: int, vocab_divisible_by: int
) -> tuple[torch.Tensor, dict[int, int]]:
    """Where each row of TP rank `tp_rank`'s shard of `param` comes from in the HF tensors, by the
    checkpoint loader's own slicing run on row numbers: `[rows, 2]` (index into `hf_names` + 1, or 0
    for a padding row; HF row), and the first HF column of a column block, by HF name index."""
    first_columns: dict[int, int] = {}

    def read(name: str, index: tuple) -> torch.Tensor:
        which = param.hf_names.index(name)
        rows = torch.arange(param.hf_shapes[which][0])[index[0]]
        if len(index) > 1:  # a block of columns (row-parallel): every row, from this column on
            first_columns[which] = range(param.hf_shapes[which][1])[index[1]].start
        return torch.stack([torch.full_like(rows, which + 1), rows], dim=1)

    mapping = ParamMapping(param.megatron_name, param.hf_names, param.kind)
    origin = tp_shard_from_hf(
        mapping, read, dims, tp_size=tp_size, tp_rank=tp_rank, vocab_divisible_by=vocab_divisible_by
    )
    return origin, first_columns


# --- engine side: what a worker's loader receives ------------------------------------------------


def recorded(
    weights: Iterable[tuple[str, torch.Tensor]], record: LoadedChecksums, rank_layout: VllmRankLayout | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """`weights` as they are, each tensor checksummed into `record` as the loader takes it (so a
    streamed tensor is read before its buffer is reused). `rank_layout`: the tensors are a per-rank
    sync's (vLLM names and per-rank shapes); None: full HF tensors."""
    dtype = getattr(torch, record.dtype)
    for name, tensor in weights:
        if rank_layout is None or rank_layout.whole(name):
            record.full[name] = tensor_checksum(tensor, dtype)
        else:
            add_into(record.partial, rank_layout.checksums(name, tensor, dtype))
        yield name, tensor


@dataclass(frozen=True)
class VllmRankLayout:
    """Which HF rows and columns vLLM worker `tp_rank`'s own tensors hold (its fused and parallel
    linear layers' and its vocabulary's per-rank layout; vLLM's `QKVParallelLinear`,
    `MergedColumnParallelLinear`, `RowParallelLinear` weight loaders and
    `VocabParallelEmbedding._get_indices`). A KV head that vLLM replicates (rollout TP > KV heads)
    counts on its first replica only, so the blocks still add up to the whole tensor."""

    dims: ModelDims
    tp_size: int
    tp_rank: int
    expert_parallel: bool = False
    """vLLM expert parallelism: the worker holds whole experts (its expert TP is 1)."""

    def whole(self, name: str) -> bool:
        """Whether the tensor is a whole HF tensor (the norms, the router)."""
        return not any(
            part in name
            for part in (
                "qkv_proj.",
                "gate_up_proj.",
                "o_proj.",
                "down_proj.",
                "embed_tokens.",
                "lm_head.",
                ".w13_weight",
                ".w2_weight",
            )
        )

    def checksums(self, name: str, tensor: torch.Tensor, dtype: torch.dtype) -> dict[str, int]:
        """The HF tensors' partial checksums of this worker's per-rank tensor `name`."""
        prefix, _, leaf = name.rpartition(".")  # e.g. "model.layers.0.self_attn.qkv_proj", "weight"
        if leaf in ("w13_weight", "w2_weight"):  # one expert's: prefix "model.layers.0.mlp.experts.{e}"
            return self._expert_checksums(prefix, leaf, tensor, dtype)
        module, _, kind = prefix.rpartition(".")
        if kind in ("embed_tokens", "lm_head"):  # rows of the padded vocabulary
            per_rank = vllm_vocab_rows(self.dims, self.tp_size)
            first = min(self.tp_rank * per_rank, self.dims.vocab_size)
            real = min(first + per_rank, self.dims.vocab_size) - first
            return {name: block_checksum(tensor[:real], dtype, torch.arange(first, first + real))}
        if kind in ("o_proj", "down_proj"):  # a block of columns of every row
            columns = tensor.shape[1]
            return {name: block_checksum(tensor, dtype, torch.arange(tensor.shape[0]), self.tp_rank * columns)}
        parts = {
            "qkv_proj": (("q_proj", self.dims.q_size), ("k_proj", self.dims.kv_size), ("v_proj", self.dims.kv_size)),
            "gate_up_proj": (("gate_proj", self.dims.ffn_hidden_size), ("up_proj", self.dims.ffn_hidden_size)),
        }
        replicas = max(1, self.tp_size // self.dims.num_kv_heads)  # vLLM's num_kv_head_replicas
        checksums, row = {}, 0
        for hf_kind, hf_rows in parts[kind]:
            kv = hf_kind in ("k_proj", "v_proj")
            local = hf_rows * replicas // self.tp_size if kv else hf_rows // self.tp_size
            block = slice(row, row + local)
            hf_row_numbers = torch.arange(local) + (self.tp_rank // replicas if kv else self.tp_rank) * local
            if not (kv and self.tp_rank % replicas):
                checksums[f"{module}.{hf_kind}.{leaf}"] = block_checksum(tensor[block], dtype, hf_row_numbers)
            row += local
        return checksums

    def _expert_checksums(self, expert: str, leaf: str, tensor: torch.Tensor, dtype: torch.dtype) -> dict[str, int]:
        """One expert's `w13_weight` rows `[gate_r; up_r]` or `w2_weight` columns (`schedule.vllm_rank_name`),
        cut over the worker's TP ranks, or whole with expert parallelism."""
        tp_size, tp_rank = (1, 0) if self.expert_parallel else (self.tp_size, self.tp_rank)
        width = self.dims.moe_ffn_hidden_size // tp_size
        if leaf == "w2_weight":
            return {
                f"{expert}.down_proj.weight": block_checksum(
                    tensor, dtype, torch.arange(tensor.shape[0]), tp_rank * width
                )
            }
        rows = torch.arange(width) + tp_rank * width
        gate, up = tensor.split(width)
        return {
            f"{expert}.gate_proj.weight": block_checksum(gate, dtype, rows),
            f"{expert}.up_proj.weight": block_checksum(up, dtype, rows),
        }


# --- the comparison ------------------------------------------------------------------------------


def checksum_problems(expected: Mapping[str, int], loaded: Sequence[LoadedChecksums]) -> list[str]:
    """Every way one engine's workers' `loaded` differs from `expected`, one line per HF tensor:
    a whole tensor must match on every worker that loaded it whole, TP blocks summed over the workers;
    a tensor no worker loaded is missing, one not expected is unexpected."""
    problems = []
    blocks = combine(record.partial for record in loaded)
    for name, want in expected.items():
        got = [(f"rollout worker {w}", record.full[name]) for w, record in enumerate(loaded) if name in record.full]
        if name in blocks:
            got.append(("its TP blocks summed over the workers", blocks[name]))
        if not got:
            problems.append(f"{name}: loaded by no worker")
        problems += [
            f"{name}: {who} loaded checksum {value:#x}, the actor's is {want:#x}" for who, value in got if value != want
        ]
    for name in sorted(set().union(blocks, *(record.full for record in loaded)) - set(expected)):
        problems.append(f"{name}: loaded but not in the actor's weights")
    return problems


def check_checksums(
    expected: Mapping[str, int], loaded: Sequence[LoadedChecksums], *, dtype: str, layout: LayoutPair, engine: str
) -> dict[str, float]:
    """`sync/checksum_tensors` (HF tensors verified exactly); raises `WeightChecksumError` naming
    the tensors of `engine` that differ, are missing or unexpected. `expected` was checksummed in
    `dtype`, which must be the engine's."""
    engine_dtypes = sorted({record.dtype for record in loaded})
    if engine_dtypes != [dtype]:
        raise WeightChecksumError(
            f"weight sync {layout}: {engine} runs in {'/'.join(engine_dtypes)}, but the actor's checksums were "
            f"taken in {dtype}; start the engines with dtype={dtype} (model.dtype) or check in theirs"
        )
    problems = checksum_problems(expected, loaded)
    if problems:
        more = f"; and {len(problems) - SHOWN} more" if len(problems) > SHOWN else ""
        raise WeightChecksumError(
            f"weight sync {layout}: {engine} ({dtype}) did not load the actor's weights bit for bit, "
            f"{len(problems)} of {len(expected)} tensors: "
            + "; ".join(problems[:SHOWN])
            + more
            + ". A tensor named here converts or travels wrongly (its mapping, the transport, or the cast to the "
            "engine's dtype); `megarl check-sync` reproduces a layout outside training"
        )
    return {"sync/checksum_tensors": float(len(expected))}
