"""Observation text from a chat template: Qwen2.5's rendering of tool messages and the end of the
assistant turn the model may or may not have written itself.

`QWEN_TOOLS` reproduces the parts of Qwen2.5-Instruct's chat template (tokenizer_config.json) that matter
here: ChatML turns `<|im_start|>{role}\\n{content}<|im_end|>\\n`, and consecutive `tool` messages rendered
as one user turn of `\\n<tool_response>\\n{content}\\n</tool_response>` blocks.
"""

from megarl.models.tiny import build_char_tokenizer
from megarl.rollout import ObservationEncoder

QWEN_TOOLS = (
    "{%- for message in messages %}"
    "{%- if message.role == 'tool' %}"
    "{%- if loop.index0 == 0 or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def encoder(template: str) -> ObservationEncoder:
    tokenizer = build_char_tokenizer()
    tokenizer.chat_template = template
    return ObservationEncoder(tokenizer)


def tool(content: str) -> dict:
    return {"role": "tool", "name": "calculator", "content": content}


def test_a_turn_stopped_at_its_tool_call_gets_the_end_of_turn_then_the_tool_turn():
    observations = encoder(QWEN_TOOLS)
    assert observations.turn_end == "<|im_end|>\n"
    text = observations.text([tool("95")], '<tool_call>{"name": "calculator"}</tool_call>')
    assert (
        text == "<|im_end|>\n<|im_start|>user\n<tool_response>\n95\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )


def test_a_turn_that_wrote_its_end_of_turn_token_gets_only_the_rest():
    text = encoder(QWEN_TOOLS).text([tool("95")], "<tool_call>...</tool_call><|im_end|>")
    assert text.startswith("\n<|im_start|>user\n")


def test_the_calls_of_one_turn_come_back_as_one_user_turn():
    text = encoder(QWEN_TOOLS).text([tool("1"), tool("2")], "</tool_call>")
    assert text.count("<|im_start|>user") == 1 and text.count("<tool_response>") == 2


def test_the_tiny_template():
    observations = encoder(build_char_tokenizer().chat_template)
    assert observations.turn_end == "\n"
    assert observations.text([tool("95")], "</s>") == "\ntool: 95\nassistant: "
    ids = observations.encode([tool("95")], "</s>")
    assert observations.tokenizer.decode(ids) == "\ntool: 95\nassistant: "
