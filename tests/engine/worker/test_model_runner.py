"""The runner's guard around an accelerator's memory: an out-of-memory error becomes one line naming what did not
fit and the flag that fixes it."""
import pytest
import torch

from zhuzi.engine.worker.model_runner import out_of_memory


def test_an_out_of_memory_error_is_one_line_naming_the_flag():
    with pytest.raises(ValueError) as caught:
        with out_of_memory("the weights", "lower --n-gpu-layers"):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB.\nmore lines")
    assert str(caught.value) == ("out of GPU memory: the weights did not fit; lower --n-gpu-layers (CUDA out of "
                                 "memory. Tried to allocate 2.00 GiB.)")
    assert caught.value.__cause__ is None and caught.value.__suppress_context__
