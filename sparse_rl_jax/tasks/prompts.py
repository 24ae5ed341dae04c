"""Prompt templates: raw text, the SimpleRL ``\\boxed{}`` instruction, a tokenizer's chat template.

A record's prompt is either a string (a question, or an already chat-formatted prompt) or a
list of chat messages ``[{"role": ..., "content": ...}, ...]``. Templates:

- ``raw``: a string used verbatim (e.g. SimpleRL-Zoo's Qwen-formatted ``prompt``).
- ``boxed``: ``question + "\\n" + instruction`` as plain text (no chat markup).
- ``chat``: the tokenizer's chat template with the generation prompt appended, applied to the
  record's messages verbatim, or to ``[system?, user: question + "\\n" + instruction]`` for a
  string question (set ``instruction=""`` to leave the question alone).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

BOXED_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."
"""The instruction of the Sparse-RL / SimpleRL-Zoo runs (appended after a newline)."""
TEMPLATES = ("raw", "boxed", "chat")

Messages = Sequence[Mapping[str, str]]


def with_instruction(question: str, instruction: str) -> str:
    """``question`` followed by a newline and ``instruction`` (the question alone if empty)."""
    return f"{question}\n{instruction}" if instruction else question


def check_messages(value: Any) -> list[dict[str, str]]:
    """``value`` as a list of ``{"role", "content"}`` string dicts, or a ValueError saying why."""
    if not isinstance(value, list) or not value:
        raise ValueError(f"chat messages must be a non-empty list, got {type(value).__name__}")
    out = []
    for i, msg in enumerate(value):
        if not (
            isinstance(msg, Mapping)
            and isinstance(msg.get("role"), str)
            and isinstance(msg.get("content"), str)
        ):
            raise ValueError(f"chat message {i} must have string 'role' and 'content', got {msg!r}")
        out.append({"role": msg["role"], "content": msg["content"]})
    return out


def check_chat_tokenizer(tokenizer: Any) -> None:
    """Raises ValueError unless ``tokenizer`` can apply a chat template."""
    if tokenizer is None or not hasattr(tokenizer, "apply_chat_template"):
        raise ValueError("template='chat' needs a tokenizer with apply_chat_template")
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            f"template='chat': tokenizer {getattr(tokenizer, 'name_or_path', tokenizer)!r} "
            "has no chat_template"
        )


def render_prompt(
    value: str | Messages,
    template: str,
    *,
    tokenizer: Any = None,
    instruction: str = BOXED_INSTRUCTION,
    system_prompt: str | None = None,
) -> str:
    """The prompt string for a record's prompt ``value`` under ``template``.

    Args:
      value: a question / prompt string, or chat messages (``chat`` template only).
      template: one of ``TEMPLATES``.
      tokenizer: a ``transformers`` tokenizer with a chat template (``chat`` only).
      instruction: appended to a string question by ``boxed`` and ``chat``.
      system_prompt: optional system message that ``chat`` puts before a string question.

    Raises:
      ValueError: unknown template, a value of the wrong kind for it, an empty prompt, or a
        missing chat template.
    """
    if template not in TEMPLATES:
        raise ValueError(f"template={template!r} must be one of {TEMPLATES}")
    if isinstance(value, str) and not value.strip():
        raise ValueError("the prompt is empty")
    if template == "chat":
        check_chat_tokenizer(tokenizer)
        if isinstance(value, str):
            messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
            messages.append({"role": "user", "content": with_instruction(value, instruction)})
        else:
            messages = check_messages(value)
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    if not isinstance(value, str):
        raise ValueError(
            f"template={template!r} needs a string prompt, got {type(value).__name__} "
            "(use template='chat' for chat messages)"
        )
    return value if template == "raw" else with_instruction(value, instruction)
