"""Errors users see: each message is one line naming the input and what to do about it."""


class Qwen3VLError(Exception):
    """Base class for every error this package raises on purpose."""


class InputError(Qwen3VLError, ValueError):
    """A bad image, video, message or prompt."""


class ContextLengthError(InputError):
    """A prompt longer than the model's context; `prompt_tokens` and `context` say by how much."""

    def __init__(self, message, prompt_tokens: int, context: int):
        super().__init__(message)
        self.prompt_tokens, self.context = prompt_tokens, context


class ConfigError(Qwen3VLError, ValueError):
    """A config.json that is not a Qwen3-VL config or lacks what we need."""


class WeightsError(Qwen3VLError, ValueError):
    """Missing, unexpected, truncated or mis-shaped weights."""


class ModelNotFoundError(Qwen3VLError, FileNotFoundError):
    """A model path that does not exist locally and cannot be downloaded."""
