"""A problem's prompt as the policy sees it: its text through the tokenizer's chat template.

With a chat template (``task.chat_template`` 'auto' and the tokenizer has one, or 'on'),
the prompt is the messages [system (task.system_prompt)] + the record's chat messages or
one user message, rendered with the generation prompt and ``task.chat_template_kwargs``
(e.g. enable_thinking = false), and encoded WITHOUT an added BOS (the template writes its
own, as transformers' apply_chat_template(tokenize=True) does). Without one the prompt
text is encoded with BOS (the embedded task's ids).
"""

from __future__ import annotations

from titan_spec.config import TaskConfig

__all__ = ["PromptFormat"]


class PromptFormat:
    """task.system_prompt / chat_template / chat_template_kwargs for one tokenizer."""

    def __init__(self, task: TaskConfig, tokenizer):
        # task.chat_template = 'on' and task.system_prompt need a template: checked before the
        # start (preflight/inputs.py check_chat_template).
        self.chat = getattr(tokenizer, "chat_template", None) is not None and task.chat_template != "off"
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
