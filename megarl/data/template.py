"""From a dataset prompt (a string or chat messages) to the text and token ids the model sees.

`data.chat_template`:
- true: the tokenizer's own chat template, with the generation prompt appended (the assistant turn opens);
- a string: that Jinja template, used the same way (it receives `messages` and `add_generation_prompt`);
- false: the raw prompt string; chat messages are then an error.

A string prompt becomes one user message when a template is used. Templated text already holds the
model's special tokens, so it is tokenized without adding any; raw text gets the tokenizer's usual
ones (BOS for Llama, nothing for Qwen), as a plain `tokenizer(text)` would.
"""

from __future__ import annotations

from typing import Any

import jinja2

from megarl.data.files import DataError


class PromptRenderer:
    """Applies `data.chat_template` and tokenizes; one instance per dataset load."""

    def __init__(self, tokenizer, chat_template: bool | str, tools: list[dict] | None = None):
        """`tools`: the OpenAI-style function schemas of a multi-turn run's tools, given to the template
        (`apply_chat_template(tools=...)`) so the prompt tells the model what it may call."""
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.tools = tools
        if chat_template is True and not getattr(tokenizer, "chat_template", None):
            raise DataError(
                f"data.chat_template is true but the tokenizer ({tokenizer.name_or_path or 'in use'}) has "
                "no chat template; set data.chat_template: false (raw text) or give a Jinja template string"
            )

    @property
    def templated(self) -> bool:
        return self.chat_template is not False

    def render(self, prompt: str | list[dict[str, Any]], location: str) -> str:
        """The text the model sees for one dataset prompt (already checked to be a string or messages)."""
        if not self.templated:
            if isinstance(prompt, list):
                raise DataError(
                    f"{location}: the prompt is a list of chat messages but data.chat_template is false; "
                    "set data.chat_template: true (the tokenizer's template) or a Jinja template string"
                )
            return prompt
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        custom = self.chat_template if isinstance(self.chat_template, str) else None
        try:
            return self.tokenizer.apply_chat_template(
                messages, chat_template=custom, tokenize=False, add_generation_prompt=True, tools=self.tools
            )
        except jinja2.TemplateError as error:
            which = "data.chat_template" if custom else "the tokenizer's chat template"
            raise DataError(
                f"{location}: {which} failed on this prompt ({type(error).__name__}: {error}); "
                "fix the template or set data.chat_template: false"
            ) from None

    def tokenize(self, texts: list[str]) -> list[list[int]]:
        """Token ids of each text (one batched tokenizer call)."""
        if not texts:
            return []
        return self.tokenizer(texts, add_special_tokens=not self.templated)["input_ids"]
