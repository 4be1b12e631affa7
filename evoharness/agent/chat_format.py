"""How a prompt string becomes model input: one user turn rendered by the tokenizer's chat
template. SFT, GRPO and the HF policy all call ``render``, so the tokens match too."""

from __future__ import annotations


def messages(prompt: str) -> list[dict]:
    return [{"role": "user", "content": prompt}]


def render(tokenizer, prompt: str) -> str:
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(messages(prompt), tokenize=False, add_generation_prompt=True)
    return prompt
