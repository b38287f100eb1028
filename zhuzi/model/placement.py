"""Where the model lives (worker -> model): which decoder layers' weights and KV pages are on the accelerator
(--device) and which on the CPU, as llama.cpp's --n-gpu-layers puts them: the first N layers on the
accelerator, the rest on the CPU. The embedding, final norm and LM head go with the CPU unless every layer is
on the accelerator, so a step's hidden state crosses once each way."""
from __future__ import annotations

import re
from dataclasses import dataclass

import torch

_LAYER = re.compile(r"model\.layers\.(\d+)\.")
CPU = torch.device("cpu")


@dataclass(frozen=True)
class Placement:
    accelerator: torch.device  # --device
    num_layers: int
    gpu_layers: int  # the first gpu_layers layers are on the accelerator (0..num_layers)

    @classmethod
    def of(cls, device: str | torch.device, n_gpu_layers: int, num_layers: int) -> Placement:
        """n_gpu_layers < 0 (or beyond the model's layers): every layer on the accelerator."""
        n = num_layers if n_gpu_layers < 0 else min(n_gpu_layers, num_layers)
        return cls(torch.device(device), num_layers, n)

    @property
    def split(self) -> bool:
        """Whether some layers are on the accelerator and the others on the CPU (even where the accelerator
        is the CPU itself: the same path, which is how a machine without a GPU tests it)."""
        return 0 < self.gpu_layers < self.num_layers

    def layer(self, i: int) -> torch.device:
        return self.accelerator if i < self.gpu_layers else CPU

    def on_accelerator(self, i: int) -> bool:
        return i < self.gpu_layers

    @property
    def ends(self) -> torch.device:
        """The embedding's, final norm's and LM head's device: the step's inputs and logits are there."""
        return self.accelerator if self.gpu_layers == self.num_layers else CPU

    def of_tensor(self, name: str) -> torch.device:
        """The device of a checkpoint tensor, by the layer its name says (model.layers.N.), else the ends'."""
        m = _LAYER.match(name)
        return self.layer(int(m.group(1))) if m else self.ends

    @property
    def devices(self) -> list[torch.device]:
        """Every device holding a layer, the accelerator first."""
        return list(dict.fromkeys([self.layer(0), self.layer(self.num_layers - 1)]))

    def __str__(self) -> str:
        if not self.split:
            return f"every layer on {self.ends}"
        def layers(first: int, last: int) -> str:
            return f"layer {first}" if first == last else f"layers {first}-{last}"
        rest = layers(self.gpu_layers, self.num_layers - 1)
        return f"{layers(0, self.gpu_layers - 1)} on {self.accelerator}, {rest} and the embedding and LM head on cpu"


def same_device(a: torch.device, b: torch.device) -> bool:
    """Whether a and b name one device ("cuda" is the current one: cuda:0 unless told otherwise)."""
    return a.type == b.type and (a.index is None or b.index is None or a.index == b.index)
