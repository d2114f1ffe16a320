"""megarl's on-disk Megatron model checkpoint: megatron-core `dist_checkpointing` (torch_dist) of the
model's `sharded_state_dict()`, plus what turns it back into an HF checkpoint with no other input.

    <dir>/megarl_model.json   format, the TP/PP it was saved from, vocab padding, the HF config
    <dir>/hf_assets/          config.json, tokenizer files, generation config of the source HF model
    <dir>/model/              dist_checkpointing torch_dist files (loadable at any TP/PP)

Reading the metadata imports no megatron (the CLI validates before starting processes).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

FORMAT = "megarl-mcore-model/1"
METADATA_FILE = "megarl_model.json"
ASSETS_DIR = "hf_assets"
MODEL_DIR = "model"


@dataclass(frozen=True)
class McoreCheckpointInfo:
    """Contents of `megarl_model.json`."""

    format: str
    """Always `FORMAT`; other values are rejected."""
    tp_size: int
    """Tensor-parallel size the checkpoint was written from (any TP/PP can load it)."""
    pp_size: int
    """Pipeline-parallel size it was written from."""
    vocab_divisible_by: int
    """Megatron vocab padding multiple (× TP) the model was built with."""
    hf_config: dict[str, Any]
    """The source HF config.json."""

    def vocab_divisible_by_at(self, tp_size: int) -> int:
        """The `vocab_divisible_by` that gives this checkpoint's padded vocab rows at `tp_size`.

        The padded embedding is part of the saved tensors, so a load at another TP must build the
        same number of rows: divisible_by × tp stays equal to the saved one.
        """
        saved_multiple = self.vocab_divisible_by * self.tp_size
        if saved_multiple % tp_size:
            raise ValueError(
                f"tensor parallel size {tp_size} cannot load a checkpoint whose vocab is padded to a multiple "
                f"of {saved_multiple} (saved at TP={self.tp_size}): use a TP that divides {saved_multiple}"
            )
        return saved_multiple // tp_size


def write_info(ckpt_dir: Path, info: McoreCheckpointInfo) -> None:
    """Write `megarl_model.json` (after the model files: its presence marks a complete checkpoint)."""
    (Path(ckpt_dir) / METADATA_FILE).write_text(json.dumps(asdict(info), indent=2) + "\n")


def read_info(ckpt_dir: str | Path) -> McoreCheckpointInfo:
    """Read and check `megarl_model.json`; errors name the path and what is wrong."""
    path = Path(ckpt_dir) / METADATA_FILE
    if Path(ckpt_dir).is_file():
        raise FileNotFoundError(
            f"{ckpt_dir} is a file, not a directory: pass the directory `megarl convert hf-to-mcore` wrote"
        )
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} not found: {ckpt_dir} is not a megarl Megatron checkpoint (write one with "
            "`megarl convert hf-to-mcore`)"
        )
    try:
        info = McoreCheckpointInfo(**json.loads(path.read_text()))
    except (UnicodeDecodeError, json.JSONDecodeError, TypeError) as error:
        raise ValueError(
            f"{path} is damaged ({error}): write the checkpoint again with `megarl convert hf-to-mcore`"
        ) from None
    if info.format != FORMAT:
        raise ValueError(f"{path}: format={info.format!r}, this megarl reads {FORMAT!r}")
    if not (Path(ckpt_dir) / MODEL_DIR).is_dir() or not (Path(ckpt_dir) / ASSETS_DIR).is_dir():
        raise FileNotFoundError(f"{ckpt_dir}: {MODEL_DIR}/ or {ASSETS_DIR}/ is missing (incomplete checkpoint)")
    return info


def save_model_shards(model: torch.nn.Module, model_dir: str | Path) -> None:
    """Collective over all ranks: write every rank's shards of `model` to an existing empty dir."""
    from megatron.core import dist_checkpointing
    from megatron.core.utils import unwrap_model

    dist_checkpointing.save(unwrap_model(model).sharded_state_dict(), str(model_dir))


def load_model_shards(model: torch.nn.Module, model_dir: str | Path) -> None:
    """Collective over all ranks: fill `model` from a dist checkpoint saved at any TP/PP."""
    from megatron.core import dist_checkpointing
    from megatron.core.utils import unwrap_model

    model = unwrap_model(model)
    state = dist_checkpointing.load(model.sharded_state_dict(), str(model_dir))
    model.load_state_dict(state)
