"""The token ids of a tool observation, from the model's own chat template.

After a model turn that called tools, the trajectory continues with: what the template puts after an
assistant turn that the model did not write itself (Qwen2.5: the "\n" after its `<|im_end|>` stop
token; the whole `<|im_end|>\n` when the turn stopped on `</tool_call>`), the tool messages as the
template renders them (Qwen2.5: one user turn of `<tool_response>` blocks), and the header of the next
assistant turn. Those texts come from rendering a fixed conversation with and without the tool
messages and taking the difference, so any template that renders `tool` messages works. They are
tokenized on their own and appended to the model's token ids as they are: nothing the model wrote is
ever re-tokenized.
"""

from __future__ import annotations

from collections.abc import Sequence

_PLACEHOLDER = "\u2063megarl-turn\u2063"
"""Content of the fixed assistant turn: text no template adds by itself."""


class ObservationEncoder:
    """`encode(tool_messages, turn_text)`: the token ids that follow a turn that called tools."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._base = [{"role": "user", "content": "?"}, {"role": "assistant", "content": _PLACEHOLDER}]
        rendered = self._render(self._base, generation_prompt=False)
        self._prefix = rendered
        self.turn_end = rendered[rendered.rindex(_PLACEHOLDER) + len(_PLACEHOLDER) :]
        """What the template writes after an assistant turn's content."""

    def text(self, tool_messages: Sequence[dict], turn_text: str) -> str:
        """The observation as text: the rest of the turn's end, the tool messages, the next assistant header.
        `tool_messages`: `{"role": "tool", "name": ..., "content": ...}` each; `turn_text`: the turn as
        the model wrote it (special tokens included), whose stop token may already be part of the end."""
        rendered = self._render(self._base + list(tool_messages), generation_prompt=True)
        if not rendered.startswith(self._prefix):
            raise ValueError(
                "the chat template renders the turns before tool messages differently once they "
                "are added; its tool turns cannot be appended token for token"
            )
        return _rest_of(self.turn_end, turn_text) + rendered[len(self._prefix) :]

    def capped(self, content: str, max_tokens: int) -> tuple[str, bool]:
        """`content` (one tool message's) cut to its first `max_tokens` tokens and a note, and whether it
        was cut. Tokenizes growing prefixes (8 characters per token allowed first), never the whole of a
        long text."""
        chars = 8 * max_tokens
        while True:
            head = content[:chars]
            ids = self.tokenizer.encode(head, add_special_tokens=False)
            if len(ids) > max_tokens:
                break
            if len(head) == len(content):
                return content, False
            chars *= 2
        kept = self.tokenizer.decode(ids[:max_tokens])
        return f"{kept}\n[truncated: the first {max_tokens} tokens of {len(content)} characters]", True

    def encode(self, tool_messages: Sequence[dict], turn_text: str) -> list[int]:
        return self.tokenizer.encode(self.text(tool_messages, turn_text), add_special_tokens=False)

    def _render(self, messages: list[dict], generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)


def _rest_of(end: str, turn_text: str) -> str:
    """`end` without its longest prefix that `turn_text` already ends with."""
    for k in range(len(end), 0, -1):
        if turn_text.endswith(end[:k]):
            return end[k:]
    return end
