"""The KV connector with a real model (tiny, float32): pages that left the pool come back from the host and
disk tiers instead of being computed, give the tokens computing gives (q8_0 pages too), survive a restart,
and are never loaded into another model or dtype; a corrupt file is recomputed."""
import logging
import shutil

import pytest
import tiny
from kv_load import GREEDY, PAGE, ids, llm, push_out

from zhuzi.engine.core.kv.page_manager import page_hash


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    directory = tmp_path_factory.mktemp("llama")
    tiny.build("llama", directory)
    return str(directory)


@pytest.fixture(scope="module")
def other_model(tmp_path_factory) -> str:
    """The same layout, other weights."""
    directory = tmp_path_factory.mktemp("llama-other")
    tiny.build("llama", directory, rope_theta=20000.0)
    return str(directory)


A = ids(0)  # 4 full pages; the 3 before its last token can be found


def computed(model: str, prompt: list[int]) -> list[int]:
    return llm(model, enable_prefix_caching=False).generate([prompt], GREEDY)[0].outputs[0].token_ids


def test_pages_evicted_to_host_memory_come_back_with_the_tokens_computing_gives(model):
    engine = llm(model, kv_offload_memory="1MiB")
    first = engine.generate([A], GREEDY)[0]
    push_out(engine)
    hits_before = engine.engine.stats().prefix_cache_hits
    again = engine.generate([A], GREEDY)[0]
    stats = engine.engine.stats()
    assert again.num_cached_tokens == 48 and stats.prefix_cache_hits == hits_before  # none from the pool itself
    assert stats.kv_tiers["host"].hit_tokens == 48 and stats.kv_tiers["host"].stored >= 4
    assert again.outputs[0].token_ids == first.outputs[0].token_ids == computed(model, A)


def test_q8_0_pages_evicted_to_host_memory_come_back_with_the_tokens_computing_gives(tmp_path):
    tiny.build("llama", tmp_path, num_attention_heads=2, num_key_value_heads=1)  # head_dim 32: one q8_0 block
    q8 = {"kv_cache_dtype": "q8_0", "kv_cache_memory": 12 * PAGE * 2 * 2 * 34}  # 12 pages of 2 layers' K and V
    engine = llm(str(tmp_path), kv_offload_memory="1MiB", **q8)
    first = engine.generate([A], GREEDY)[0]
    push_out(engine)
    again = engine.generate([A], GREEDY)[0]
    assert again.num_cached_tokens == 48 and engine.engine.stats().kv_tiers["host"].hit_tokens == 48
    computed = llm(str(tmp_path), enable_prefix_caching=False, **q8).generate([A], GREEDY)[0].outputs[0].token_ids
    assert again.outputs[0].token_ids == first.outputs[0].token_ids == computed


def test_the_disk_tier_serves_after_a_restart_only_the_same_model_and_dtype(model, other_model, tmp_path):
    first = llm(model, kv_offload_dir=str(tmp_path))
    expected = first.generate([A], GREEDY)[0].outputs[0].token_ids
    first.engine.shutdown()  # what was queued is written; a kill -9 keeps what was renamed into place
    restarted = llm(model, kv_offload_dir=str(tmp_path))
    again = restarted.generate([A], GREEDY)[0]
    assert again.num_cached_tokens == 48 and restarted.engine.stats().kv_tiers["disk"].hit_tokens == 48
    assert again.outputs[0].token_ids == expected
    assert llm(model, dtype="bfloat16", kv_offload_dir=str(tmp_path)).generate([A], GREEDY)[0].num_cached_tokens == 0
    other = llm(other_model, kv_offload_dir=str(tmp_path))
    assert other.generate([A], GREEDY)[0].num_cached_tokens == 0
    assert len(list(tmp_path.iterdir())) == 3  # a folder per model and dtype


def test_a_foreign_or_corrupt_page_file_is_never_loaded_and_the_prompt_is_computed(model, other_model, tmp_path,
                                                                                   caplog):
    writer = llm(model, kv_offload_dir=str(tmp_path / "ours"))
    expected = writer.generate([A], GREEDY)[0].outputs[0].token_ids
    writer.engine.shutdown()
    (folder,) = (tmp_path / "ours").iterdir()
    reader = llm(other_model, kv_offload_dir=str(tmp_path / "theirs"))
    (theirs,) = (tmp_path / "theirs").iterdir()
    for file in folder.iterdir():  # our pages, under the names the other model would look for
        shutil.copy(file, theirs / file.name)
    with caplog.at_level(logging.WARNING, "zhuzi"):
        out = reader.generate([A], GREEDY)[0]
    assert out.num_cached_tokens == 0 and "written for another model" in caplog.text
    assert out.outputs[0].token_ids == computed(other_model, A)

    second = folder / (page_hash(page_hash(None, A[:PAGE]), A[PAGE:2 * PAGE]).hex() + ".kv")
    raw = bytearray(second.read_bytes())
    raw[-1] ^= 0x01
    second.write_bytes(raw)
    caplog.clear()
    with caplog.at_level(logging.WARNING, "zhuzi"):
        out = llm(model, kv_offload_dir=str(tmp_path / "ours")).generate([A], GREEDY)[0]
    assert "checksum mismatch" in caplog.text
    assert out.num_cached_tokens == 16 and out.outputs[0].token_ids == expected  # page 1 loaded, the rest computed
