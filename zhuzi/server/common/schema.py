"""The base of every API's words (OpenAI's in openai/protocol.py and openai/answers.py, Anthropic's, the
Responses API's, the inspector's, the pins'): requests are strict models that refuse unknown fields, with text
that is valid Unicode and content given as a string or a list of parts; answers are Response models.
"""
from __future__ import annotations

from typing import Annotated, Any

import pydantic
from pydantic import AfterValidator, BaseModel, ConfigDict, Field


def _utf8_only(text: str) -> str:
    # JSON may carry lone surrogates ("\ud800"); no tokenizer can encode them.
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError("text must be valid Unicode (found a lone surrogate)") from exc
    return text


Text = Annotated[str, AfterValidator(_utf8_only)]

# How long a request's model stays loaded after it (Ollama's keep_alive, which zhuzi's OpenAI requests take too):
# a Go duration ("5m", "1h30m", "-1s") or a number of seconds; negative: for ever, 0: unloaded after the request.
DURATION = r"^-?(\d+(\.\d+)?(ns|us|µs|ms|s|m|h))+$|^-?\d+(\.\d+)?$"
KeepAlive = Annotated[str, Field(pattern=DURATION)] | int | float


def text_or(parts: Any, min_parts: int = 0) -> Any:
    """A string, or a list of parts: an error then names what is wrong in the form the client chose."""
    def form(value: Any) -> str | None:
        return "text" if isinstance(value, str) else "parts" if isinstance(value, list) else None

    return Annotated[Annotated[Text, pydantic.Tag("text")]
                     | Annotated[list[parts], Field(min_length=min_parts), pydantic.Tag("parts")],
                     pydantic.Discriminator(form, custom_error_type="text_or_parts",
                                            custom_error_message="must be a string or a list of parts")]


class Request(BaseModel):
    # NaN or Infinity (JSON extensions, or 1e999) would reach the sampler as poison.
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, strict=True)


def _is_none(value: Any) -> bool:
    return value is None


class Response(BaseModel):
    """The base of every API's answers."""
