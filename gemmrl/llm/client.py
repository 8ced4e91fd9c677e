"""A small OpenAI-compatible chat client (POST {base}/chat/completions), stdlib only.

Configured from the environment: GEMMRL_LLM_BASE_URL, GEMMRL_LLM_MODEL, GEMMRL_LLM_API_KEY. The
key is sent only in the Authorization header: it is never part of repr(), logs or error text
(every message that leaves this module passes through `redact`). Timeouts, retries with
exponential backoff on 429 / 5xx / network errors (Retry-After honoured), a minimum interval
between requests, `n` samples per request and a token budget (sum of usage.total_tokens) that
refuses further calls once spent.
"""

from __future__ import annotations

import json
import logging
import os
import random
import socket
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field

log = logging.getLogger("gemmrl.llm")

ENV_BASE_URL = "GEMMRL_LLM_BASE_URL"
ENV_MODEL = "GEMMRL_LLM_MODEL"
ENV_API_KEY = "GEMMRL_LLM_API_KEY"
RETRY_STATUSES = (408, 409, 429, 500, 502, 503, 504)


class LLMError(RuntimeError):
    pass


class BudgetExceeded(LLMError):
    pass


@dataclass
class Completion:
    texts: list[str]  # one per sample (choice), in order
    usage: dict
    model: str
    attempts: int  # HTTP requests it took (1 = no retry)


@dataclass
class LLMClient:
    base_url: str
    model: str
    api_key: str = field(default="", repr=False)
    timeout_s: float = 120.0
    max_retries: int = 4
    backoff_s: float = 1.0
    max_backoff_s: float = 30.0
    min_interval_s: float = 0.0  # rate limit: at least this long between request starts
    token_budget: int | None = None  # total tokens (usage.total_tokens) this client may spend
    temperature: float = 0.8
    max_tokens: int | None = None
    tokens_used: int = field(default=0, init=False)
    requests_made: int = field(default=0, init=False)

    def __post_init__(self):
        if not self.base_url:
            raise LLMError(f"no base URL: set {ENV_BASE_URL}")
        if not self.model:
            raise LLMError(f"no model name: set {ENV_MODEL}")
        self.base_url = self.base_url.rstrip("/")
        self._lock = threading.Lock()
        self._last_start = 0.0

    def __repr__(self) -> str:
        key = "set" if self.api_key else "unset"
        return (f"LLMClient(base_url={self.redact(self.base_url)!r}, model={self.model!r}, "
                f"api_key=<{key}>, tokens_used={self.tokens_used}, token_budget={self.token_budget})")

    @classmethod
    def from_env(cls, env=None, **kw) -> "LLMClient":
        env = os.environ if env is None else env
        return cls(env.get(ENV_BASE_URL, ""), env.get(ENV_MODEL, ""), env.get(ENV_API_KEY, ""), **kw)

    def redact(self, text) -> str:
        text = str(text)
        if self.api_key:
            text = text.replace(self.api_key, "<redacted>")
        return text

    @property
    def tokens_left(self) -> float:
        return float("inf") if self.token_budget is None else self.token_budget - self.tokens_used

    def _wait_interval(self) -> None:
        with self._lock:
            wait = self._last_start + self.min_interval_s - time.monotonic()
            if wait > 0:
                time.sleep(wait)
            self._last_start = time.monotonic()

    def _request(self, body: bytes) -> dict:
        headers = {"Content-Type": "application/json", "Accept": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        req = urllib.request.Request(f"{self.base_url}/chat/completions", data=body, headers=headers,
                                     method="POST")
        with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
            return json.loads(resp.read().decode("utf-8"))

    def chat(self, messages: list[dict], n: int = 1, **extra) -> Completion:
        """`n` samples for one prompt. Raises BudgetExceeded before calling when the budget is
        spent, LLMError when retries run out or the reply is not a chat completion."""
        if self.tokens_left <= 0:
            raise BudgetExceeded(f"token budget exhausted: {self.tokens_used} of {self.token_budget} "
                                 "tokens used; refusing to call the model")
        payload = {"model": self.model, "messages": messages, "n": int(n),
                   "temperature": self.temperature}
        if self.max_tokens:
            payload["max_tokens"] = self.max_tokens
        payload.update(extra)
        body = json.dumps(payload).encode()
        last = ""
        for attempt in range(1, self.max_retries + 2):
            self._wait_interval()
            self.requests_made += 1
            retry_after = None
            try:
                data = self._request(body)
                break
            except urllib.error.HTTPError as e:
                detail = ""
                try:
                    detail = e.read().decode("utf-8", "replace")[:500]
                except Exception:
                    pass
                last = self.redact(f"HTTP {e.code} {e.reason}: {detail}")
                if e.code not in RETRY_STATUSES:
                    raise LLMError(f"chat completion failed: {last}") from None
                ra = e.headers.get("Retry-After") if e.headers else None
                try:
                    retry_after = float(ra) if ra is not None else None
                except ValueError:
                    retry_after = None
            except (urllib.error.URLError, socket.timeout, TimeoutError, ConnectionError) as e:
                last = self.redact(f"{type(e).__name__}: {getattr(e, 'reason', e)}")
            except json.JSONDecodeError as e:
                last = f"reply is not JSON: {e}"
            if attempt > self.max_retries:
                raise LLMError(f"chat completion failed after {attempt} attempts: {last}")
            delay = retry_after if retry_after is not None else min(
                self.max_backoff_s, self.backoff_s * 2 ** (attempt - 1)) * (1 + 0.1 * random.random())
            log.warning("LLM request attempt %d failed (%s); retrying in %.2f s", attempt, last, delay)
            time.sleep(max(0.0, min(delay, self.max_backoff_s)))
        try:
            texts = [(c.get("message") or {}).get("content") or "" for c in data["choices"]]
        except (KeyError, TypeError, AttributeError):
            raise LLMError(self.redact(f"not a chat completion: {str(data)[:300]}")) from None
        usage = data.get("usage") or {}
        total = usage.get("total_tokens")
        if total is None:
            total = int(usage.get("prompt_tokens", 0)) + int(usage.get("completion_tokens", 0))
        self.tokens_used += int(total)
        return Completion(texts, dict(usage), str(data.get("model", self.model)), attempt)
