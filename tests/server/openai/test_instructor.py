"""instructor, unmodified, against the session's default `zhuzi serve` (SmolLM2-135M-Instruct): a pydantic model
out of its default mode with OpenAI (TOOLS: a forced function call) and out of JSON_SCHEMA (OpenAI's json_schema
response format). zhuzi's grammars hold the small model to the schema, so these tests are about the protocol."""
from __future__ import annotations

import openai
import pytest
from pydantic import BaseModel
from server_process import ServerProcess

instructor = pytest.importorskip("instructor", reason="make test-clients installs it")

MODEL = "SmolLM2-135M-Instruct"
pytestmark = pytest.mark.clients


class City(BaseModel):
    name: str
    country: str


@pytest.mark.parametrize("mode", [None, instructor.Mode.JSON_SCHEMA])
def test_a_pydantic_model_comes_out(server: ServerProcess, mode: instructor.Mode | None) -> None:
    sdk = openai.OpenAI(api_key="none", base_url=server.api, max_retries=0, timeout=120)
    client = instructor.from_openai(sdk) if mode is None else instructor.from_openai(sdk, mode=mode)
    assert mode is not None or client.mode is instructor.Mode.TOOLS  # instructor's default with OpenAI
    city = client.chat.completions.create(
        model=MODEL, response_model=City, max_retries=0, temperature=0, max_tokens=64,
        messages=[{"role": "user", "content": "Name the capital of France and its country."}])
    assert isinstance(city, City) and city.name and city.country
