"""A policy served by any OpenAI-compatible chat endpoint. The key is read from the environment
at call time and never stored, logged or fingerprinted."""

from __future__ import annotations

import os

import httpx

from evoharness.episode import Privileged, TurnView
from evoharness.errors import PolicyError


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
        url = f"{self.base_url}/chat/completions"
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
            raise PolicyError(f"chat endpoint {url} unreachable ({type(e).__name__})") from None
        if r.status_code != 200:
            raise PolicyError(f"chat endpoint {url} answered HTTP {r.status_code}: {r.text[:120]!r}")
        try:
            return r.json()["choices"][0]["message"]["content"] or ""
        except (ValueError, KeyError, IndexError, TypeError):
            raise PolicyError(f"chat endpoint {url} answered something that is not a chat completion: {r.text[:120]!r}") from None


class ChatPolicy:
    def __init__(self, base_url: str, model: str, api_key_env: str = "OPENAI_API_KEY", temperature: float = 0.0, max_tokens: int = 256):
        self.endpoint = ChatEndpoint(base_url, model, api_key_env, temperature, max_tokens)
        self.name = f"chat:{model}"

    def fingerprint(self) -> str:
        e = self.endpoint
        from evoharness.secrets import redact

        return f"chat:v1:{redact(e.base_url)}:{e.model}:{e.temperature}:{e.max_tokens}"

    def reset(self, seed: int) -> None:
        pass

    def act(self, prompt: str, view: TurnView, privileged: Privileged) -> str:
        return self.endpoint.complete(prompt)
