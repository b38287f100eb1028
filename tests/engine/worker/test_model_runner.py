"""The runner's guards around an accelerator: an out-of-memory error becomes one line naming what did not fit and
the flag that fixes it; a CUDA device torch cannot see, one line before anything loads."""
import pytest
import torch

from zhuzi.config import EngineConfig
from zhuzi.engine.worker.model_runner import load_runner, out_of_memory


def test_an_out_of_memory_error_is_one_line_naming_the_flag():
    with pytest.raises(ValueError) as caught:
        with out_of_memory("the weights", "lower --n-gpu-layers"):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB.\nmore lines")
    assert str(caught.value) == ("out of GPU memory: the weights did not fit; lower --n-gpu-layers (CUDA out of "
                                 "memory. Tried to allocate 2.00 GiB.)")
    assert caught.value.__cause__ is None and caught.value.__suppress_context__


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is here")
def test_a_cuda_device_torch_cannot_see_is_one_line():
    with pytest.raises(ValueError, match=r"^--device cuda: torch sees no CUDA device here"):
        load_runner(EngineConfig(device="cuda"))
