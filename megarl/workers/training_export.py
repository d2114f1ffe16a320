"""A `megarl train` checkpoint's actor, read for `megarl convert mcore-to-hf`: the checks made before any
process starts, and the per-rank load.

A training checkpoint (`megarl.workers.checkpoint`) holds the actor's Megatron shards under
`step_<N>/actor/model/` (loadable at any TP/PP), written at the run's TP (its manifest's layout), with
the run's vocabulary padding (`VOCAB_DIVISIBLE_BY` x that TP), but no HF config or tokenizer: those come
from the run's `model.path` (`--hf`). Before a rank loads it, the step dir must be complete and every
file's SHA-256 the manifest's (`checkpoint_files.read_manifest`, `verify_checksums`), and the shards must
have the shapes of the `--hf` model (`.metadata` of the dist checkpoint, read without megatron).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from megarl.models.hf_config import ModelDims, read_model_dims
from megarl.models.layout import VOCAB_DIVISIBLE_BY, padded_vocab_size
from megarl.workers.checkpoint_files import MANIFEST, STEP_DIR, CheckpointError, read_manifest, verify_checksums

ACTOR = "actor"
MODEL_DIR = "model"
EMBEDDING = "embedding.word_embeddings.weight"
"""The dist checkpoint key of the (padded) input embedding [V_padded, H]."""
LAYER_PREFIX = "decoder.layers."
"""Keys of the stacked transformer layers: [num_layers, ...] each."""
_PARTIAL = re.compile(r"^step_\d{8,}\.tmp-[0-9a-f]+$")


@dataclass(frozen=True)
class ActorCheckpoint:
    """A training checkpoint's actor, checked against the HF model it was trained from."""

    step_dir: Path
    """The `step_<N>` directory."""
    saved_tp: int
    """The tensor-parallel size the run saved it at (its vocabulary padding depends on it)."""
    dtype: str
    """The weights' dtype as saved, e.g. "float32", "bfloat16" (the model is built in it)."""

    def vocab_divisible_by_at(self, tp_size: int) -> int:
        """The `vocab_divisible_by` that rebuilds the saved padded vocabulary at `tp_size`."""
        saved_multiple = VOCAB_DIVISIBLE_BY * self.saved_tp
        if saved_multiple % tp_size:
            raise ValueError(
                f"--tp {tp_size} cannot load {self.step_dir}, whose vocabulary is padded to a multiple of "
                f"{saved_multiple} (saved at TP={self.saved_tp}): use a --tp that divides {saved_multiple}"
            )
        return saved_multiple // tp_size


def is_training_checkpoint(path: Path) -> bool:
    """A `step_<N>` dir of `megarl train` (its manifest or its name), a save that did not finish, or the
    `checkpoint.dir` that holds them."""
    return (
        (path / MANIFEST).is_file()
        or bool(STEP_DIR.match(path.name))
        or bool(_PARTIAL.match(path.name))
        or any(STEP_DIR.match(step.name) for step in path.glob("step_*"))
    )


def check_actor_checkpoint(step_dir: Path, hf_dir: Path | None) -> ActorCheckpoint:
    """The checks of a training checkpoint given to `convert mcore-to-hf`, every byte read once.

    Raises ValueError naming the path, what is wrong and what to pass instead.
    """
    _check_is_a_step(step_dir)
    try:
        manifest = read_manifest(step_dir)
    except CheckpointError as error:
        raise ValueError(
            f"{error}: convert another step of the run (a complete step_<N> directory) or restore this one from a copy"
        ) from None
    if ACTOR not in manifest.roles:
        actor_dir = step_dir.parent.parent / step_dir.name
        raise ValueError(
            f"{step_dir} holds the {', '.join(manifest.roles)} model, not the actor: a critic has no HF "
            f"form; pass the run's actor checkpoint ({actor_dir})"
        )
    try:
        verify_checksums(step_dir, manifest)
    except CheckpointError as error:
        raise ValueError(f"{error}: convert another step of the run or restore this one from a copy") from None
    if hf_dir is None:
        raise ValueError(
            f"{step_dir} is a training checkpoint, which holds no HF config or tokenizer: pass "
            "--hf MODEL_DIR, the run's model.path (its config.json and tokenizer files are copied)"
        )
    dims = read_model_dims(hf_dir)
    shapes, dtype = _saved_shapes(step_dir / ACTOR / MODEL_DIR)
    _check_shapes(step_dir, hf_dir, dims, shapes, manifest.layout["tp"])
    return ActorCheckpoint(step_dir=step_dir, saved_tp=manifest.layout["tp"], dtype=dtype)


def _check_is_a_step(path: Path) -> None:
    if not path.is_dir():
        raise ValueError(
            f"{path} does not exist or is not a directory: pass a step_<N> directory of the run's checkpoint.dir"
        )
    if _PARTIAL.match(path.name):
        raise ValueError(
            f"{path} is a save that did not finish (no checkpoint): pass a complete step_<N> directory "
            f"beside it in {path.parent}"
        )
    if not (path / MANIFEST).is_file() and not STEP_DIR.match(path.name):
        steps = sorted(step.name for step in path.glob("step_*") if STEP_DIR.match(step.name))
        raise ValueError(
            f"{path} is a checkpoint root (checkpoint.dir), not a checkpoint: pass one of its step "
            f"directories, e.g. {path / steps[-1]}"
        )


def _saved_shapes(model_dir: Path) -> tuple[dict[str, tuple[int, ...]], str]:
    """The dist checkpoint's tensor shapes by key, and the embedding's dtype (from its `.metadata`)."""
    from torch.distributed.checkpoint import FileSystemReader

    metadata = FileSystemReader(str(model_dir)).read_metadata().state_dict_metadata
    shapes = {key: tuple(item.size) for key, item in metadata.items() if hasattr(item, "size")}
    if EMBEDDING not in shapes:
        raise ValueError(f"{model_dir} holds no {EMBEDDING}: not the Megatron checkpoint of a megarl actor")
    return shapes, str(metadata[EMBEDDING].properties.dtype).removeprefix("torch.")


def _check_shapes(step_dir: Path, hf_dir: Path, dims: ModelDims, shapes: dict, saved_tp: int) -> None:
    """The shards were trained from the `--hf` model: hidden size, padded vocabulary and layer count agree."""
    rows = padded_vocab_size(dims.vocab_size, VOCAB_DIVISIBLE_BY, saved_tp)
    layers = {shape[0] for key, shape in shapes.items() if key.startswith(LAYER_PREFIX)}
    saved = (shapes[EMBEDDING][1], shapes[EMBEDDING][0], sorted(layers))
    expected = (dims.hidden_size, rows, [dims.num_layers])
    if saved != expected:
        raise ValueError(
            f"{step_dir} was not trained from --hf {hf_dir}: its actor has hidden size {saved[0]}, {saved[1]} vocabulary "
            f"rows and {saved[2]} layers, that model {expected[0]}, {expected[1]} and {expected[2]}; pass the run's "
            "model.path as --hf"
        )
