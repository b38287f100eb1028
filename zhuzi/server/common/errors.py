"""The server's refusals and failures, in no API's shape: each router renders them as its API's error object
(OpenAI's, Anthropic's, Ollama's), and a stream that has begun as its API's in-band error."""
from __future__ import annotations

import re

from zhuzi.engine.front.client import EngineDead
from zhuzi.outputs import RequestError
from zhuzi.sampling_params import InvalidRequest


class ApiError(Exception):
    """An answer other than success: its HTTP status, what went wrong, and the request field at fault."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | int | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    @classmethod
    def of(cls, exc: InvalidRequest) -> ApiError:
        return cls(400, str(exc), param=exc.param, code=exc.code)

    def renamed(self, names: dict[str, str]) -> ApiError:
        """The error under an API's names for the chat request's fields: names maps a pattern of the param to
        its replacement (re.sub), the first that matches."""
        for pattern, name in names.items():
            if self.param is not None and re.match(pattern, self.param):
                param = re.sub(pattern, name, self.param, count=1)
                return ApiError(self.status, self.message.replace(self.param, param), self.type, param, self.code)
        return self


def failure(exc: Exception) -> ApiError:
    """A request that failed after it was accepted: 400 where its own input was at fault, 503 if the engine is
    gone, else 500 (the code repeats the status, as OpenAI's in-band errors do)."""
    if isinstance(exc, EngineDead):
        return ApiError(503, f"Service unavailable: {exc}", "service_unavailable", code=503)
    if isinstance(exc, RequestError) and exc.param is not None:  # the request's own input, found as it ran
        return ApiError(400, str(exc), param=exc.param, code=400)
    if isinstance(exc, RequestError):
        return ApiError(500, f"The engine failed this request: {exc}", "internal_error", code=500)
    return ApiError(500, f"Internal server error: {type(exc).__name__}", "internal_error", code=500)
