"""HF safetensors checkpoint dirs on disk: find, validate and slice-read tensors; write them back.

No torch.distributed: the distributed loader/exporter (`checkpoint.py`) and the CLI use these.
`check_hf_checkpoint` validates a dir against its config.json (files, tensor names, shapes, the
(TP, PP) layout, floating-point dtypes) by reading only safetensors headers, so bad input is reported
before any process starts.
"""

from __future__ import annotations

import functools
import json
import shutil
from collections.abc import Iterator, Mapping
from contextlib import ExitStack, contextmanager
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from megarl.models.hf_config import ModelDims, check_parallel_layout, read_model_dims
from megarl.models.layout import TensorReader, hf_param_shapes

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")
"""safetensors dtypes of weights megarl can load (cast to model.dtype); others are integers, FP8 or booleans."""
# Weight files are written by the exporter; everything else in a checkpoint dir (config.json,
# generation_config.json, tokenizer files, chat template) is copied as is.
_WEIGHT_SUFFIXES = (".safetensors", ".safetensors.index.json", ".bin", ".bin.index.json", ".pt", ".pth")


class HFCheckpoint:
    """Tensor name → safetensors file of a checkpoint dir (single `model.safetensors` or sharded index)."""

    def __init__(self, hf_dir: str | Path):
        self.dir = Path(hf_dir)
        self.files: dict[str, Path] = _tensor_files(self.dir)

    @functools.cached_property
    def headers(self) -> dict[str, tuple[tuple[int, ...], str]]:
        """Every tensor's shape and safetensors dtype ("BF16", "F32", "I8", ...), from the headers only."""
        headers = {}
        for path in sorted(set(self.files.values())):
            with _open_safetensors(path) as f:
                for name in f.keys():
                    tensor = f.get_slice(name)
                    headers[name] = (tuple(tensor.get_shape()), tensor.get_dtype())
        return headers

    @functools.cached_property
    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor's shape, from the safetensors headers only."""
        return {name: shape for name, (shape, _) in self.headers.items()}

    def require(self, name: str, shape: tuple[int, ...]) -> None:
        """Raise KeyError if tensor `name` is absent, ValueError (naming the file) if its shape differs."""
        if name not in self.shapes:
            raise KeyError(f"HF checkpoint {self.dir}: tensor {name!r} is missing")
        if self.shapes[name] != shape:
            raise ValueError(
                f"{self.files[name]}: tensor {name!r} has shape {list(self.shapes[name])}, "
                f"config.json implies {list(shape)}"
            )

    @contextmanager
    def reader(self) -> Iterator[TensorReader]:
        """A `TensorReader` that reads only the requested slice of each tensor (files kept open)."""
        with ExitStack() as stack:
            handles = {}

            def read(name: str, index: tuple) -> torch.Tensor:
                if name not in self.files:
                    raise KeyError(f"HF checkpoint {self.dir}: tensor {name!r} is missing")
                path = self.files[name]
                if path not in handles:
                    handles[path] = stack.enter_context(_open_safetensors(path))
                return handles[path].get_slice(name)[index]

            yield read


def check_hf_checkpoint(
    hf_dir: str | Path, *, tp_size: int = 1, pp_size: int = 1, ep_size: int = 1, etp_size: int | None = None
) -> ModelDims:
    """Validate an HF checkpoint dir for megarl at (tp_size, pp_size, ep_size, etp_size) and return its dims.

    Raises ValueError / FileNotFoundError naming the file and tensor: unsupported config, a layout the
    model cannot be cut into, missing shard files, missing or unexpected tensors, wrong shapes or
    non-float dtypes.
    """
    dims = read_model_dims(hf_dir)
    check_parallel_layout(dims, tp_size=tp_size, pp_size=pp_size, ep_size=ep_size, etp_size=etp_size)
    checkpoint = HFCheckpoint(hf_dir)
    found = checkpoint.shapes
    expected = hf_param_shapes(dims)
    problems = []
    for name, shape in expected.items():
        try:
            checkpoint.require(name, shape)
        except (KeyError, ValueError) as e:
            problems.append(str(e.args[0]))
            continue
        dtype = checkpoint.headers[name][1]
        if dtype not in FLOAT_DTYPES:
            problems.append(
                f"{checkpoint.files[name]}: tensor {name!r} has dtype {dtype}, not a floating-point type "
                "(a quantized checkpoint?): megarl trains and converts float32, bfloat16 or float16 "
                "weights; use the model's unquantized checkpoint"
            )
    # A tied checkpoint may still carry lm_head.weight (a copy); rotary inv_freq buffers are derived.
    ignorable = {"lm_head.weight"} if dims.tie_word_embeddings else set()
    unexpected = sorted(n for n in set(found) - set(expected) - ignorable if not n.endswith("rotary_emb.inv_freq"))
    if unexpected:
        more = " ..." if len(unexpected) > 5 else ""
        problems.append(
            f"HF checkpoint {checkpoint.dir}: tensors not in the {dims.model_type} layout: {unexpected[:5]}{more}"
        )
    if problems:
        shown = problems[:8] + ([f"... and {len(problems) - 8} more"] if len(problems) > 8 else [])
        raise ValueError("; ".join(shown))
    return dims


def write_safetensors_shard(tensors: Mapping[str, torch.Tensor], path: Path) -> None:
    """One safetensors file (contiguous CPU tensors, `format: pt` metadata as transformers writes)."""
    save_file({name: t.detach().cpu().contiguous() for name, t in tensors.items()}, path, metadata={"format": "pt"})


def write_index(out_dir: Path, weight_map: Mapping[str, str], total_size: int) -> None:
    """`model.safetensors.index.json` for a sharded checkpoint."""
    index = {"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))}
    (out_dir / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")


def copy_hf_assets(src_dir: Path, out_dir: Path) -> None:
    """Copy config.json, tokenizer files, generation config, chat template: every non-weight file."""
    for path in sorted(Path(src_dir).iterdir()):
        if path.is_file() and not path.name.endswith(_WEIGHT_SUFFIXES):
            shutil.copy2(path, out_dir / path.name)


def _open_safetensors(path: Path):
    """`safe_open(path)`; a damaged file (truncated, or not safetensors at all) is a ValueError naming it."""
    try:
        return safe_open(path, framework="pt")
    except SafetensorError as error:
        raise ValueError(f"{path} is not a complete safetensors file ({error}): copy or download it again") from None


def _tensor_files(hf_dir: Path) -> dict[str, Path]:
    index = hf_dir / INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        missing = sorted({f for f in weight_map.values() if not (hf_dir / f).is_file()})
        if missing:
            raise FileNotFoundError(f"{index} lists shard files that do not exist: {missing}")
        return {name: hf_dir / file for name, file in weight_map.items()}
    single = hf_dir / SINGLE_FILE
    if single.is_file():
        with _open_safetensors(single) as f:
            return dict.fromkeys(f.keys(), single)
    raise FileNotFoundError(f"{hf_dir}: no {SINGLE_FILE} or {INDEX_FILE} (megarl reads safetensors checkpoints only)")
