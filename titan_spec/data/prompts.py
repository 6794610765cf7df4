"""A problem's prompt as the policy sees it: its text through the tokenizer's chat template.

With a chat template (``task.chat_template`` 'auto' and the tokenizer has one, or 'on'),
the prompt is the messages [system (task.system_prompt)] + the record's chat messages or
one user message, rendered with the generation prompt and ``task.chat_template_kwargs``
(e.g. enable_thinking = false), and encoded WITHOUT an added BOS (the template writes its
own, as transformers' apply_chat_template(tokenize=True) does). Without one the prompt
text is encoded with BOS, the embedded task's ids exactly as before.
"""

from __future__ import annotations

from titan_spec.config import ConfigError, TaskConfig

__all__ = ["PromptFormat"]


class PromptFormat:
    """task.system_prompt / chat_template / chat_template_kwargs for one tokenizer."""

    def __init__(self, task: TaskConfig, tokenizer):
        has = getattr(tokenizer, "chat_template", None) is not None
        if task.chat_template == "on" and not has:
            raise ConfigError("task.chat_template = 'on' but the tokenizer has no chat template "
                              "(tokenizer_config.json chat_template or chat_template.jinja)", key="task.chat_template")
        self.chat = has and task.chat_template != "off"
        if task.system_prompt and not self.chat:
            raise ConfigError("task.system_prompt needs a chat template, and the tokenizer has none",
                              key="task.system_prompt")
        self.system_prompt = task.system_prompt
        self.kwargs = dict(task.chat_template_kwargs)
        self.tokenizer = tokenizer

    def messages(self, problem) -> list[dict[str, str]]:
        msgs = list(getattr(problem, "messages", ()) or ({"role": "user", "content": problem.prompt},))
        if self.system_prompt and not any(m["role"] == "system" for m in msgs):
            msgs.insert(0, {"role": "system", "content": self.system_prompt})
        return msgs

    def text(self, problem) -> str:
        """The prompt text the policy continues."""
        if not self.chat:
            return problem.prompt
        return self.tokenizer.apply_chat_template(self.messages(problem), add_generation_prompt=True, **self.kwargs)

    def ids(self, problem) -> list[int]:
        """The prompt's token ids (BOS added only without a chat template)."""
        return self.tokenizer.encode(self.text(problem), add_bos=not self.chat)
