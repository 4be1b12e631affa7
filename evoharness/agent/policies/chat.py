"""A policy served by any OpenAI-compatible chat endpoint. The key is read from the environment
at call time and never stored, logged or fingerprinted."""

from __future__ import annotations

import os

import httpx

from evoharness.agent.episode import Privileged, TurnView
from evoharness.core.errors import PolicyError

MAX_REPLY_BYTES = 1 << 20  # one completion of an action turn is a few hundred bytes


class ChatEndpoint:
    def __init__(self, base_url: str, model: str, api_key_env: str = "OPENAI_API_KEY", temperature: float = 0.0, max_tokens: int = 256, timeout: float = 60.0):
        if not base_url or not model:
            raise PolicyError("chat policy needs base_url and model (e.g. chat:base_url=http://host:8000/v1,model=NAME)")
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.api_key_env = api_key_env
        self.temperature = temperature
        self.max_tokens = max_tokens
        self.timeout = timeout

    def complete(self, prompt: str) -> str:
        from evoharness.core.secrets import redact

        url = f"{self.base_url}/chat/completions"
        shown = redact(url)  # the endpoint as errors (and the episodes that keep them) name it
        headers = {}
        key = os.environ.get(self.api_key_env)
        if key:
            headers["Authorization"] = f"Bearer {key}"
        body = {
            "model": self.model,
            "messages": [{"role": "user", "content": prompt}],
            "temperature": self.temperature,
            "max_tokens": self.max_tokens,
        }
        try:
            r = httpx.post(url, json=body, headers=headers, timeout=self.timeout)
        except httpx.HTTPError as e:
            raise PolicyError(f"chat endpoint {shown} unreachable ({type(e).__name__})") from None
        if r.status_code != 200:
            raise PolicyError(f"chat endpoint {shown} answered HTTP {r.status_code}: {redact(r.text[:120])!r}")
        if len(r.content) > MAX_REPLY_BYTES:
            raise PolicyError(f"chat endpoint {shown} answered {len(r.content)} bytes, more than {MAX_REPLY_BYTES} for one reply")
        try:
            return r.json()["choices"][0]["message"]["content"] or ""
        except (ValueError, KeyError, IndexError, TypeError):
            raise PolicyError(f"chat endpoint {shown} answered something that is not a chat completion: {redact(r.text[:120])!r}") from None


class ChatPolicy:
    def __init__(self, base_url: str, model: str, api_key_env: str = "OPENAI_API_KEY", temperature: float = 0.0, max_tokens: int = 256):
        self.endpoint = ChatEndpoint(base_url, model, api_key_env, temperature, max_tokens)
        self.name = f"chat:{model}"

    def fingerprint(self) -> str:
        e = self.endpoint
        from evoharness.core.secrets import redact

        return f"chat:v1:{redact(e.base_url)}:{e.model}:{e.temperature}:{e.max_tokens}"

    def reset(self, seed: int) -> None:
        pass

    def act(self, prompt: str, view: TurnView, privileged: Privileged) -> str:
        return self.endpoint.complete(prompt)
