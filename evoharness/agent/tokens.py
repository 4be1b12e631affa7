"""The word-level pre-tokenizer of the tiny profile: words, numbers, tags and punctuation.

The tiny tokenizer (built in the base_model stage) splits text with this same pattern, so a
count here is its exact token count; for other tokenizers it is a close proxy used for the
length checks of the validation gate.
"""

from __future__ import annotations

import re

PATTERN = r"</?[a-z]+>|[A-Za-z]+|\d+|[^\sA-Za-z\d]"
_RE = re.compile(PATTERN)


def words(text: str) -> list[str]:
    return _RE.findall(text)


def count(text: str) -> int:
    return len(_RE.findall(text))
