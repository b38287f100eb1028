"""The OpenAPI spec describes the real API: schemathesis, knowing only /openapi.json, fuzzes the app
in-process (a tiny random Llama with SmolLM2's tokenizer and vocabulary, so generation is fast) and
finds no 5xx and no answer outside the spec."""
from __future__ import annotations

import os

import pytest
import schemathesis
import tiny
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import positive_data_acceptance

from zhuzi.config import EngineConfig, ParallelConfig, ServerConfig
from zhuzi.engine.front.core_client import EngineCoreClient
from zhuzi.server.app import create_app

EXAMPLES = int(os.environ.get("ZHUZI_FUZZ_EXAMPLES", 25))  # per route and mode: a few seconds each in make test
BODIES = [("POST", "/v1/chat/completions"), ("POST", "/v1/completions"), ("POST", "/tokenize"), ("POST", "/detokenize"),
          ("POST", "/inspect/next-token"), ("POST", "/inspect/logit-lens"), ("POST", "/inspect/document"),
          ("POST", "/inspect/bpe"), ("GET", "/inspect/engine"), ("POST", "/v1/chat/completions/render"),
          ("POST", "/v1/messages"), ("POST", "/v1/messages/count_tokens"), ("POST", "/v1/responses"),
          ("GET", "/v1/responses/{response_id}/input_items"), ("POST", "/api/chat"), ("POST", "/api/generate"),
          ("POST", "/api/show")]
# Routes without a body or parameters (or with a path's string alone) have no invalid request to make.
CASES = [(*route, mode) for route in BODIES for mode in GenerationMode] + [
    ("GET", path, GenerationMode.POSITIVE) for path in ("/v1/models", "/health", "/version", "/metrics",
                                                        "/v1/responses/{response_id}", "/api/tags", "/api/ps",
                                                        "/api/version")] + [
    ("DELETE", "/v1/responses/{response_id}", GenerationMode.POSITIVE)]


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny-llama")
    tiny.build("llama", directory, vocab_size=49152)
    config = EngineConfig(model=str(directory), dtype="float32", kv_cache_memory="16MiB", max_model_len=64,
                          max_num_seqs=8)
    engine = EngineCoreClient(config, ParallelConfig(engine_process=False)).start()
    yield create_app(engine, ServerConfig(max_waiting=8, responses_store=str(directory / "responses.sqlite3")))
    engine.close()


@pytest.fixture(scope="module")
def api_schema(app):
    return schemathesis.openapi.from_asgi("/openapi.json", app)


@pytest.mark.parametrize("method,path,mode", CASES)
def test_fuzzed_requests_get_no_5xx_and_answers_that_fit_the_spec(api_schema, method, path, mode):
    """Every check but one: a request that fits the schema may still be refused (400), since no schema says
    that token ids must be in the vocabulary or that a prompt must fit the context window."""
    operation = api_schema[path][method]

    @given(case=operation.as_strategy(mode))
    @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), database=None,
              derandomize=True)  # the same examples on every run: a failure reproduces
    def fuzz(case):
        case.call_and_validate(excluded_checks=[positive_data_acceptance])

    fuzz()
