"""A multi-turn run's training and validation prompts tell the model its tools: `Trainer` reads the tools'
schemas in their isolated workers (`Trainer._tool_schemas`) and hands them to the chat template
(`PromptRenderer(tools=)`). Here with the agent quickstart's recipe, the tiny tool-token model's template
(`megarl.models.tiny.TOOL_CHAT_TEMPLATE`: a `tools: name(parameters, ...)` line before the turns) and a
user tool beside the built-in calculator; nothing but the Trainer's constructor runs (no Ray)."""

import shutil
from pathlib import Path

from megarl.config.loader import load_config
from megarl.models.tiny import build_char_tokenizer, make_tiny_model
from megarl.trainer.trainer import Trainer

CONFIGS = Path(__file__).resolve().parents[3] / "configs"
TOOLS_LINE = "tools: calculator(expression), records_interval(path, seconds)\n"


def test_the_tool_schemas_reach_the_training_and_validation_prompts(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    make_tiny_model(tmp_path / "model", tool_tokens=True)
    (tmp_path / "train.jsonl").write_text("".join(f'{{"prompt": "{k}+35", "answer": "{k + 35}"}}\n' for k in range(16)))
    shutil.copy(tmp_path / "train.jsonl", tmp_path / "val.jsonl")
    config = load_config(
        CONFIGS / "agent_quickstart.yaml",
        [
            f"model.path={tmp_path / 'model'}",
            f"data.train_files=[{tmp_path / 'train.jsonl'}]",
            f"data.val_files=[{tmp_path / 'val.jsonl'}]",
            "data.max_prompt_length=128",
            "rollout.multi_turn.tools=[{function: calculator}, {function: 'tools_testing:records_interval'}]",
        ],
    )
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "tools"))  # tools_testing, for the worker

    trainer = Trainer(config)

    expected = build_char_tokenizer(tool_tokens=True).apply_chat_template(
        [{"role": "user", "content": "0+35"}], tokenize=False, add_generation_prompt=True, tools=trainer._tool_schemas()
    )
    assert expected == TOOLS_LINE + "user: 0+35\nassistant: "
    for prompt in (*trainer.loader.prompts, *trainer.val_prompts):
        assert prompt.text.startswith(TOOLS_LINE)
        assert trainer.tokenizer.decode(prompt.token_ids) == prompt.text
    assert expected in {prompt.text for prompt in trainer.loader.prompts}
