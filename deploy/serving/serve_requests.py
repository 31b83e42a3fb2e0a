"""What rtrl serve accepts (deploy/serving/serve_api.py's routes): OpenAI's request bodies, each
field it implements, and a 400 naming any other -- a parameter silently ignored would hand the
client an answer of another shape, or from another distribution, than it asked for."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from pipeline.core.types import Identifier


class SamplingRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    max_tokens: int = Field(default=16, ge=1, le=4096)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=4096)  # the newer name of max_tokens
    temperature: float = Field(default=1.0, ge=0.0, le=5.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    seed: int | None = None
    user: Identifier | None = None  # the event's user_id: an identifier (no NUL, not blank, <= 256)
    n: int = Field(default=1, ge=1, le=16)
    stream: bool = False
    stream_options: dict[str, Any] | None = None  # {"include_usage": true}: a last chunk with usage
    logprobs: bool | int | None = None  # the answer always carries the sampled tokens' log-probs
    top_logprobs: int | None = Field(default=None, ge=0, le=0)  # only the sampled token's (0), as vLLM's default
    return_tokens_as_token_ids: bool = False  # vLLM's: each token as "token_id:<id>" (and its bytes)
    return_token_ids: bool = False  # vLLM's: each choice's (each chunk's) sampled token ids as `token_ids`
    # accepted only at the value that asks for nothing more than what is served
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # vLLM's, as `rtrl gateway` sends it explicitly
    min_p: float = 0.0
    top_k: int = -1  # off: -1 or 0 (vLLM's conventions)

    @field_validator("top_k")
    @classmethod
    def _no_top_k(cls, value: int) -> int:
        if value > 0:
            raise ValueError(f"top_k={value!r} is not supported by rtrl serve (only -1 or 0: off)")
        return value

    @field_validator("presence_penalty", "frequency_penalty", "repetition_penalty", "min_p")
    @classmethod
    def _only_the_default(cls, value: Any, info: Any) -> Any:
        default = cls.model_fields[info.field_name].default
        if value != default:
            raise ValueError(f"{info.field_name}={value!r} is not supported by rtrl serve (only {default!r})")
        return value

    @model_validator(mode="after")
    def _checked(self) -> SamplingRequest:
        if self.max_completion_tokens is not None:
            self.max_tokens = self.max_completion_tokens
        if self.stream and self.n > 1:
            raise ValueError("n > 1 with stream=True is not supported by rtrl serve: stream one choice per request")
        return self


class CompletionRequest(SamplingRequest):
    prompt: str = Field(min_length=1)


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")  # `name` and the like: kept by clients, not rendered

    role: Literal["system", "user", "assistant", "tool"]
    content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool result's call

    @model_validator(mode="after")
    def _content(self) -> Message:
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(f"a {self.role} message needs content (only an assistant's tool calls may stand alone)")
        return self


class ChatRequest(SamplingRequest):
    messages: list[Message] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["auto", "none"] | None = None

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _choice(cls, value: Any) -> Any:
        if value is not None and value not in ("auto", "none"):
            raise ValueError(
                f"tool_choice={value!r} is not supported by rtrl serve (only 'auto' or 'none': "
                "it cannot force the model to call a tool)"
            )
        return value

    @field_validator("tools")
    @classmethod
    def _tools(cls, tools: Any) -> Any:
        for tool in tools or ():
            fn = tool.get("function") if tool.get("type") == "function" else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                raise ValueError(
                    'each tool must be {"type": "function", "function": {"name": ..., "parameters": {...}}}'
                )
        return tools

    def parse_tools(self) -> list[dict[str, Any]] | None:
        """The tools whose calls are parsed out of the answer (none with tool_choice "none")."""
        return self.tools if self.tools and self.tool_choice != "none" else None
