"""The KV pool's shape: a stacked tensor per (KV heads, head size) of the layers that write K/V, each layer an
entry (its own or the layer's it shares), its bytes what is stored; a page is one flat row of every group."""
import torch

from zhuzi.model.kv_format import Q8_0, head_bytes
from zhuzi.model.kv_pool import KVGroup, KVPool, KVShape
from zhuzi.model.model_config import ModelConfig

TYPES = ["sliding_attention", "sliding_attention", "full_attention"] * 2
GEMMA4 = ModelConfig("gemma4", 100, 64, 128, 6, 4, 2, 32, sliding_window=5, layer_types=TYPES, global_head_dim=64,
                     num_global_kv_heads=1, num_kv_shared_layers=2, rope_local_theta=1e4)


def test_layers_are_grouped_by_shape_and_shared_layers_have_their_sources_entry():
    shape = KVShape.of_model(GEMMA4)
    assert shape.groups == (KVGroup((0, 1, 3), 2, 32), KVGroup((2,), 1, 64))
    assert shape.entries == ((0, 0), (0, 1), (1, 0), (0, 2), (0, 2), (1, 0))


def test_bytes_per_token_count_what_the_writing_layers_store():
    shape = KVShape.of_model(GEMMA4)
    for dtype in (torch.float32, torch.bfloat16, Q8_0):
        assert shape.bytes_per_token(dtype) == 2 * (3 * 2 * head_bytes(32, dtype) + 1 * 1 * head_bytes(64, dtype))
        pool = KVPool.zeros(shape, 4, dtype)
        assert sum(t.nbytes for t in pool.tensors) == 4 * shape.bytes_per_token(dtype)
    llama = ModelConfig("llama", 100, 64, 128, 6, 4, 2, 32)  # every layer its own K/V, of one shape
    assert KVShape.of_model(llama).groups == (KVGroup(tuple(range(6)), 2, 32),)


def test_a_page_reads_as_one_row_of_every_group_and_writes_back():
    pool = KVPool.zeros(KVShape.of_model(GEMMA4), 8, torch.float32)
    for t in pool.tensors:
        t.copy_(torch.randn(t.shape))
    page = pool.read(slice(4, 8))
    assert page.shape == (4 * KVShape.of_model(GEMMA4).bytes_per_token(torch.float32) // 4,)
    other = KVPool.zeros(pool.shape, 8, torch.float32)
    other.write(slice(0, 4), page)
    for a, b in zip(pool.tensors, other.tensors):
        assert torch.equal(a[:, :, 4:8], b[:, :, 0:4]) and not b[:, :, 4:].any()
    assert pool.layer(4) is not None and torch.equal(pool.layer(4), pool.layer(3))  # layer 4 reads layer 3's
