"""/v1/embeddings end to end: the official openai client against the session's --deterministic `zhuzi serve`
(SmolLM2-135M-Instruct, dense bf16: batch invariant, so a batch's vectors are bit for bit those of each input
alone). A chat model's pooled state is no good embedding, so the tests check the arithmetic, not the semantics:
each vector is the offline engine's (LLM.embed) for the same text, unit length, the same in float and base64, in
a batch and alone; bad input gets OpenAI's error object."""
from __future__ import annotations

import httpx
import openai
import pytest
import torch
from server_process import ServerProcess

from zhuzi import LLM

MODEL = "SmolLM2-135M-Instruct"
TEXTS = ["The capital of France is Paris.", "def fibonacci(n):", "Once upon a time, there was a little fox."]


@pytest.fixture(scope="module")
def server(det_server: ServerProcess) -> ServerProcess:
    return det_server


@pytest.fixture(scope="module")
def offline() -> LLM:
    return LLM(quantization="none", dtype="bfloat16", deterministic=True, kv_cache_memory="64MiB")  # the server's


def vectors(response) -> list[torch.Tensor]:
    return [torch.tensor(item.embedding) for item in response.data]


def test_each_embedding_is_the_models_final_state_mean_pooled_and_normalized(client: openai.OpenAI,
                                                                            offline: LLM) -> None:
    response = client.embeddings.create(model=MODEL, input=TEXTS, encoding_format="float")
    assert response.model == MODEL and [item.index for item in response.data] == [0, 1, 2]
    assert response.usage.prompt_tokens == response.usage.total_tokens \
        == sum(len(offline.tokenizer.encode_prompt(t)) for t in TEXTS)
    for got, want in zip(vectors(response), offline.embed(TEXTS)):
        assert got.shape == (576,) and abs(float(got.norm()) - 1) < 1e-5
        assert torch.equal(got, want)


def test_float_and_base64_batched_or_alone_text_or_token_ids_are_the_same_vector(client: openai.OpenAI,
                                                                                offline: LLM) -> None:
    batch = vectors(client.embeddings.create(model=MODEL, input=TEXTS, encoding_format="float"))
    for text, got in zip(TEXTS, batch):
        alone = client.embeddings.create(model=MODEL, input=text)  # the SDK asks for base64 and decodes it
        assert torch.equal(vectors(alone)[0], got)
        ids = client.embeddings.create(model=MODEL, input=[offline.tokenizer.encode_prompt(text)],
                                       encoding_format="float", user="someone")
        assert torch.equal(vectors(ids)[0], got)


@pytest.mark.parametrize(("body", "param", "says"), [
    ({"input": ""}, "input", "must not be empty"),
    ({"input": []}, "input", "must not be empty"),
    ({"input": ["fine", ""]}, "input.1", "must not be empty"),
    ({"input": "word " * 9000}, "input", "maximum context length"),
    ({"input": "hi", "dimensions": 64}, "dimensions", "576 dimensions"),
    ({"input": "hi", "encoding_format": "int8"}, "encoding_format", "'float' or 'base64'"),
    ({"input": [[1, 10**9]]}, "input", "outside the vocabulary"),
])
def test_bad_input_gets_openais_error_object(server: ServerProcess, body: dict, param: str, says: str) -> None:
    response = httpx.post(f"{server.api}/embeddings", json={"model": MODEL, **body}, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param and says in error["message"]


def test_the_sdk_raises_on_a_refused_request_and_the_server_goes_on(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="dimensions"):
        client.embeddings.create(model=MODEL, input="hi", dimensions=8)
    assert len(client.embeddings.create(model=MODEL, input="hi").data[0].embedding) == 576
