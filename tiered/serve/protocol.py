"""Request bodies of the OpenAI-compatible API (the fields tiered honours; others are ignored).

Field bounds are checked by pydantic; a body that breaks them is answered 400 with an OpenAI-style
error (tiered/serve/app.py).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from tiered.engine.sampling import SamplingParams


class StreamOptions(BaseModel):
    """`stream_options`: include_usage adds a last chunk with the usage and no choices."""

    include_usage: bool = False


class _Generation(BaseModel):
    """Fields shared by completions and chat completions."""

    model: str
    max_tokens: int | None = Field(None, ge=1, description="most tokens to generate (default: 16 for "
                                   "completions, the rest of the context for chat)")
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=1, description="only one choice per request")

    def sampling(self, default_max_tokens: int) -> SamplingParams:
        """The engine's SamplingParams. Raises ConfigError for values it refuses (e.g. an empty stop)."""
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        return SamplingParams(max_tokens=self.max_tokens or default_max_tokens, temperature=self.temperature,
                              top_p=self.top_p, seed=self.seed, stop=stop)

    @property
    def include_usage(self) -> bool:
        """Whether a stream ends with a usage chunk."""
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_Generation):
    """POST /v1/completions: a text prompt (no chat template), or token ids."""

    prompt: str | list[int] | list[str] = Field(..., description="text, token ids, or a list of one text")


class TextPart(BaseModel):
    """One text part of a message's content list (other part types are refused)."""

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    """One chat message; `developer` is treated as `system`."""

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[TextPart] | None = None

    def as_dict(self) -> dict:
        """{"role", "content"} with text parts joined, as the tokenizer's chat template expects."""
        content = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content or [])
        return {"role": "system" if self.role == "developer" else self.role, "content": content}


class ChatCompletionRequest(_Generation):
    """POST /v1/chat/completions: messages through the model's chat template."""

    messages: list[ChatMessage] = Field(..., min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, description="OpenAI's newer name of max_tokens")

    def sampling(self, default_max_tokens: int) -> SamplingParams:
        """As for completions, with max_completion_tokens standing in for an absent max_tokens."""
        if self.max_completion_tokens is not None and self.max_tokens is None:
            return self.model_copy(update={"max_tokens": self.max_completion_tokens}).sampling(default_max_tokens)
        return super().sampling(default_max_tokens)
