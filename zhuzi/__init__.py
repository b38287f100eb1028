"""zhuzi (逐字): an LLM inference engine and OpenAI-compatible chat server on PyTorch."""
from zhuzi.outputs import CompletionOutput, RequestOutput
from zhuzi.sampling_params import SamplingParams, StructuredOutputsParams

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "RequestOutput", "CompletionOutput", "__version__"]


def __getattr__(name: str):
    # LLM pulls in torch and the model code; load it only when asked for.
    if name == "LLM":
        from zhuzi.llm import LLM
        return LLM
    raise AttributeError(name)
