"""BFCL's tool-calling categories on Qwen2.5-Coder-0.5B-Instruct, zhuzi serve beside llama-server --jinja on the
same GGUF (`zhuzi bench tools --compare llama.cpp`, a fixed spread of each category): zhuzi's accuracy is at least
llama-server's in every category, and zhuzi makes no server error."""
import pytest

from zhuzi.bench.llamacpp import LlamaCppError, find_tool
from zhuzi.cli import build_parser

pytestmark = pytest.mark.models


def test_zhuzi_calls_tools_at_least_as_well_as_llama_server(qwen_small):
    try:
        find_tool("llama-server")
    except LlamaCppError as e:
        pytest.skip(str(e))
    args = build_parser().parse_args(["bench", "tools", "--model", str(qwen_small), "--limit", "8",
                                      "--compare", "llama.cpp"])
    zhuzi, llama = args.func(args).servers
    for ours, theirs in zip(zhuzi.categories, llama.categories):
        assert ours.errors("server") == 0, ours.failures
        assert ours.accuracy >= theirs.accuracy, (ours.category, ours.failures, theirs.failures)
