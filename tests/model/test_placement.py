"""The layer split (--n-gpu-layers): which layers' weights and KV pages go where, and that a split changes no
token. Without a GPU both sides are the CPU: the same code path, the split taken."""
import pytest
import tiny
import torch

from zhuzi import LLM, SamplingParams
from zhuzi.model.attention import AttentionMetadata, PrefillChunk
from zhuzi.model.families import family
from zhuzi.model.kv_pool import KVPool, KVShape
from zhuzi.model.loader import load_model_config
from zhuzi.model.placement import CPU, Placement, same_device


def test_the_first_layers_go_to_the_accelerator():
    p = Placement.of("cuda", 3, 5)
    assert p.split and [p.layer(i).type for i in range(5)] == ["cuda"] * 3 + ["cpu"] * 2
    assert p.ends == CPU and p.of_tensor("model.layers.2.mlp.up_proj.weight").type == "cuda"
    assert p.of_tensor("model.layers.3.mlp.up_proj.weight") == CPU and p.of_tensor("lm_head.weight") == CPU
    every = Placement.of("cuda", -1, 5)
    assert not every.split and every.gpu_layers == 5 and every.ends.type == "cuda"
    assert Placement.of("cuda", 99, 5) == every and not Placement.of("cuda", 0, 5).split
    assert same_device(torch.device("cuda"), torch.device("cuda:0")) and not same_device(CPU, torch.device("cuda"))


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama4")
    tiny.build("llama", path, layers=4)
    return path


def test_a_split_pool_holds_each_sides_layers_apart(llama):
    specs = family("llama").layers(load_model_config(str(llama)))
    shape = KVShape.of(specs, Placement.of("cpu", 1, 4))
    assert [g.layers for g in shape.groups] == [(0,), (1, 2, 3)] and shape.entries == ((0, 0), (1, 0), (1, 1), (1, 2))
    assert shape.bytes_per_token(torch.bfloat16) == KVShape.of(specs).bytes_per_token(torch.bfloat16)
    pool = KVPool.zeros(shape, 32, torch.float32)
    page = torch.arange(pool.read(slice(16, 32)).numel(), dtype=torch.float32)
    pool.write(slice(16, 32), page)
    assert torch.equal(pool.read(slice(16, 32)), page) and not pool.read(slice(0, 16)).any()


def test_metadata_moves_whole():
    meta = AttentionMetadata(torch.arange(3), 1, torch.tensor([[4, 5]]), torch.tensor([2]),
                             [PrefillChunk(1, 2, 2, torch.tensor([0, 1]))])
    moved = meta.to(CPU)
    assert moved.prefills[0].slots.tolist() == [0, 1] and moved.decode_slots.tolist() == [[4, 5]]
    assert moved.num_decode_tokens == 1 and moved.prefills[0].query_slots.shape == (2, 2)


@pytest.mark.parametrize("arch, groups", [("llama", 2), ("qwen3_5", 1)])
def test_n_gpu_layers_changes_no_token(arch, groups, llama, tmp_path):
    """Greedy tokens with layers 0-1 and 2-3 on two sides (a prompt, a prefix-cached one, decodes in a batch)
    equal the unsplit run's, in float32. Qwen3.5's first side holds recurrent layers only: its states there, its
    one attention layer's KV on the other."""
    path = llama if arch == "llama" else tmp_path
    if arch != "llama":
        tiny.build(arch, tmp_path)
    prompts = [[1, 5, 9, 200, 3], list(range(7, 40)), list(range(7, 30)) + [5]]
    params = SamplingParams(temperature=0, max_tokens=6)
    outputs = []
    for n in (-1, 2):
        llm = LLM(str(path), dtype="float32", n_gpu_layers=n, kv_cache_memory="1MiB")
        assert llm.engine.runner.model.placement.split == (n == 2)
        assert len(llm.engine.runner.kv_cache.tensors) == (groups if n == 2 else 1)
        outputs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params)])
    assert outputs[0] == outputs[1]
