"""megarl's Megatron checkpoint metadata: completeness checks and loading at another TP."""

import pytest

from megarl.models.mcore_checkpoint import FORMAT, McoreCheckpointInfo, read_info, write_info


def _info(**fields):
    return McoreCheckpointInfo(
        **{
            "format": FORMAT,
            "tp_size": 2,
            "pp_size": 2,
            "vocab_divisible_by": 128,
            "hf_config": {"model_type": "qwen2"},
            **fields,
        }
    )


def test_metadata_round_trip_and_incomplete_checkpoints(tmp_path):
    write_info(tmp_path, _info())
    with pytest.raises(FileNotFoundError, match="model/ or hf_assets/ is missing"):
        read_info(tmp_path)
    (tmp_path / "model").mkdir()
    (tmp_path / "hf_assets").mkdir()
    assert read_info(tmp_path) == _info()
    write_info(tmp_path, _info(format="other/9"))
    with pytest.raises(ValueError, match="format='other/9'"):
        read_info(tmp_path)
    with pytest.raises(FileNotFoundError, match="is not a megarl Megatron checkpoint"):
        read_info(tmp_path / "model")


def test_another_tp_keeps_the_saved_padded_vocab():
    info = _info()  # padded to a multiple of 256
    assert [info.vocab_divisible_by_at(tp) for tp in (1, 2, 4)] == [256, 128, 64]
    with pytest.raises(ValueError, match="tensor parallel size 3 cannot load .* multiple of 256"):
        info.vocab_divisible_by_at(3)
