"""zhuzi on a CUDA device (make test-gpu; left out of make test): greedy tokens equal the CPU's in float32, a
layer split changes none, the KV pool fills the GPU's share of its memory, an out-of-memory error is one line.
Every test skips, saying why, where torch sees no CUDA device."""
import subprocess
import sys

import pytest
import tiny
import torch

from zhuzi import LLM, SamplingParams
from zhuzi.model.loader import CheckpointError, default_model_path

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                  reason="no CUDA device: torch.cuda.is_available() is false")]

PROMPTS = [[1, 5, 9, 200, 3], list(range(7, 40)), list(range(7, 30)) + [5]]  # the last two share a prefix
GREEDY = SamplingParams(temperature=0, max_tokens=12)


def greedy(model: str, **options) -> tuple[LLM, list[list[int]]]:
    llm = LLM(model, dtype="float32", **options)
    return llm, [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("llama4")
    tiny.build("llama", path, layers=4)
    return str(path)


def test_greedy_tokens_on_cuda_equal_the_cpus_in_float32(llama):
    _, cpu = greedy(llama, kv_cache_memory="4MiB")
    llm, cuda = greedy(llama, device="cuda", gpu_memory_utilization=0.02)
    assert llm.engine.runner.kv_cache.tensors[0].is_cuda and llm.engine.runner.model.norm.is_cuda
    assert cuda == cpu


def test_smollm2_on_cuda_equals_the_cpu_in_float32():
    """The GGUF's blocks dequantized at load on the GPU; on the CPU, float32 runs their exact values dense."""
    try:
        path = str(default_model_path())
    except CheckpointError as exc:
        pytest.skip(str(exc))
    _, cpu = greedy(path, kv_cache_memory="16MiB")
    _, cuda = greedy(path, device="cuda", gpu_memory_utilization=0.05)
    assert cuda == cpu


def test_n_gpu_layers_changes_no_token_on_cuda(llama):
    _, every = greedy(llama, device="cuda", gpu_memory_utilization=0.02)
    llm, split = greedy(llama, device="cuda", n_gpu_layers=2, gpu_memory_utilization=0.02)
    pool = llm.engine.runner.kv_cache.tensors
    assert [t.device.type for t in pool] == ["cuda", "cpu"] and llm.engine.runner.model.norm.device.type == "cpu"
    assert split == every


def test_the_kv_pool_fills_the_gpus_share(llama):
    """--gpu-memory-utilization: weights + 0.5 GiB reserve + pool within the share, less than two pages left over;
    `zhuzi plan --device cuda` reads the same card's memory."""
    total = torch.cuda.get_device_properties(0).total_memory
    share = 2**29 + 2**26  # the reserve and 64 MiB
    llm = LLM(llama, dtype="float32", device="cuda", gpu_memory_utilization=share / total)
    pool = sum(t.nbytes for t in llm.engine.runner.kv_cache.tensors)
    weights = torch.cuda.memory_allocated(0) - pool
    left = int(total * (share / total)) - 2**29 - weights - pool
    assert 0 <= left < 2 * 16 * llm.engine.kv_plan.bytes_per_token
    out = subprocess.run([sys.executable, "-m", "zhuzi.cli", "--log-level", "WARNING", "plan", llama, "--device",
                          "cuda", "--n-gpu-layers", "2"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert f"GPU: {total / 2**30:.2f} GiB x 0.9 (--gpu-memory-utilization)" in out.stdout


def test_out_of_memory_at_load_is_one_line(tmp_path):
    tiny.build("llama", tmp_path, layers=4, hidden_size=512, intermediate_size=2048)  # 16 MiB a layer in float32
    torch.cuda.empty_cache()  # the allocator's cached blocks back to the driver: free is then what is free
    free, _ = torch.cuda.mem_get_info()
    filler = torch.empty(free - 4 * 2**20, dtype=torch.uint8, device="cuda")
    try:
        with pytest.raises(ValueError, match=r"^out of GPU memory: the weights did not fit; lower --n-gpu-layers"):
            LLM(str(tmp_path), dtype="float32", device="cuda")
    finally:
        del filler
        torch.cuda.empty_cache()
