"""benchmarks/tiled_gguf.py: a GGUF's stand-in, rebuilt from its header and a sample of each block type, has the
original's layout (every field, every tensor's type, shape and place) and runs in the engine."""
import subprocess
import sys
from pathlib import Path

import numpy as np
from gguf import GGUFReader

from zhuzi import LLM, SamplingParams

TOOL = Path(__file__).parents[2] / "benchmarks" / "tiled_gguf.py"


def tool(*args) -> None:
    subprocess.run([sys.executable, str(TOOL), *map(str, args)], check=True)


def test_a_tiled_file_has_the_original_layout_and_runs(smollm2_path: Path, tmp_path: Path):
    tool("pack", smollm2_path, tmp_path / "pack")
    carried = sum(f.stat().st_size for f in (tmp_path / "pack").iterdir())
    assert carried < smollm2_path.stat().st_size / 10
    out = tmp_path / "model.gguf"
    tool("unpack", tmp_path / "pack", smollm2_path.stem, out)

    original, tiled = GGUFReader(smollm2_path), GGUFReader(out)
    assert out.stat().st_size == smollm2_path.stat().st_size
    assert list(original.fields) == list(tiled.fields)
    assert [(t.name, t.tensor_type, list(t.shape), t.data_offset) for t in original.tensors] == \
           [(t.name, t.tensor_type, list(t.shape), t.data_offset) for t in tiled.tensors]
    # Real blocks of the same type, not the original's own values beyond the sample.
    samples = {t.tensor_type: (tmp_path / "pack" / f"{smollm2_path.stem}.{t.tensor_type.name}").read_bytes()
               for t in original.tensors}
    for t in tiled.tensors:
        data, sample = np.asarray(t.data).tobytes(), samples[t.tensor_type]
        assert data[:len(sample)] == sample[:len(data)]
    assert any(np.asarray(a.data).tobytes() != np.asarray(b.data).tobytes()
               for a, b in zip(original.tensors, tiled.tensors))

    llm = LLM(str(out), kv_cache_memory="64MiB")
    done = llm.generate([[1, 2, 3, 4]], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                        use_tqdm=False)[0]
    assert len(done.outputs[0].token_ids) == 8
