"""A GGUF file's stand-in for a machine the file cannot reach: its header and one sample of each block type.

A decode or prefill step's time depends on the tensors' types, shapes and places in the file, not on the values
their blocks hold, so a file with the same header whose every tensor is its type's sample of real blocks,
repeated, runs at the original's speed (greedy tokens differ, which a benchmark with ignore_eos does not
read). `pack` writes a few MB (the header holds the tokenizer); `unpack` rebuilds the file there.

    python benchmarks/tiled_gguf.py pack MODEL.gguf DIR        # DIR/NAME.head, NAME.json, NAME.<type>
    python benchmarks/tiled_gguf.py unpack DIR NAME OUT.gguf
"""
import argparse
import json
from pathlib import Path

SAMPLE_BYTES = 1 << 20  # of each block type: a whole number of rows, from its largest tensor


def pack(model: Path, folder: Path) -> None:
    from gguf import GGUFReader

    reader = GGUFReader(model)
    folder.mkdir(parents=True, exist_ok=True)
    name = model.stem
    with model.open("rb") as f:
        (folder / f"{name}.head").write_bytes(f.read(reader.data_offset))
    samples: dict[str, memoryview] = {}
    sizes: dict[str, int] = {}
    tensors = []
    for t in reader.tensors:
        kind, size = t.tensor_type.name, int(t.n_bytes)
        tensors.append([int(t.data_offset), size, kind])
        if size > sizes.get(kind, 0):
            row = size // int(t.shape[-1]) if len(t.shape) > 1 else size
            keep = max(row, min(SAMPLE_BYTES, size) // row * row)
            samples[kind], sizes[kind] = memoryview(t.data).cast("B")[:keep], size
    for kind, data in samples.items():
        (folder / f"{name}.{kind}").write_bytes(data)
    (folder / f"{name}.json").write_text(json.dumps({"size": model.stat().st_size, "tensors": tensors}))


def unpack(folder: Path, name: str, out: Path) -> None:
    layout = json.loads((folder / f"{name}.json").read_text())
    samples: dict[str, bytes] = {}
    with out.open("wb") as f:
        f.write((folder / f"{name}.head").read_bytes())
        for offset, size, kind in layout["tensors"]:
            sample = samples.setdefault(kind, (folder / f"{name}.{kind}").read_bytes())
            f.seek(offset)
            f.write((sample * -(-size // len(sample)))[:size])
        f.truncate(layout["size"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    verbs = parser.add_subparsers(dest="verb", required=True)
    p = verbs.add_parser("pack", help="MODEL.gguf -> DIR: its header and a sample of each block type")
    p.add_argument("model", type=Path)
    p.add_argument("folder", type=Path)
    u = verbs.add_parser("unpack", help="DIR NAME -> OUT.gguf: a file of the same layout")
    u.add_argument("folder", type=Path)
    u.add_argument("name")
    u.add_argument("out", type=Path)
    args = parser.parse_args()
    if args.verb == "pack":
        pack(args.model, args.folder)
    else:
        unpack(args.folder, args.name, args.out)


if __name__ == "__main__":
    main()
