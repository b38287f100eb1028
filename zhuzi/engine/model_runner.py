"""Model runner: owns the KV pool, turns a scheduled step into tensors, runs the forward pass,
samples, scores prompt tokens for prompt_logprobs, and reads out inspections (probes)."""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from zhuzi.config import EngineConfig
from zhuzi.engine.sequence import ScheduledSeq
from zhuzi.model.attention import AttentionMetadata, PrefillChunk
from zhuzi.model.decoder import Decoder, LayerTap
from zhuzi.model.loader import Checkpoint, load_checkpoint
from zhuzi.model.parallel import TPGroup
from zhuzi.outputs import Inspection, LensLayer, Logprob
from zhuzi.sampler import Sampler, SamplingRow, token_logprobs
from zhuzi.tokenizer import Tokenizer

# Prompt logprobs are computed this many positions at a time, so a long chunk never needs a
# second [tokens, vocab] tensor of logits.
_PROMPT_ROWS = 256

PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass
class StepResult:
    sampled: list[tuple[ScheduledSeq, int, dict[int, Logprob] | None]] = field(default_factory=list)
    # seq_id -> entries of the prompt tokens this chunk predicts
    prompt_logprobs: dict[int, PromptLogprobs] = field(default_factory=dict)
    failed: list[tuple[ScheduledSeq, Exception]] = field(default_factory=list)  # rows that failed alone
    inspections: list[tuple[ScheduledSeq, Inspection]] = field(default_factory=list)  # probes that reached their end


def measure_read_bandwidth(device: str | torch.device = "cpu", nbytes: int = 256 << 20, repeats: int = 5) -> float:
    """Bytes/s of the fastest of `repeats` full reads (torch.sum) of a buffer larger than any cache."""
    buffer = torch.ones(nbytes // 4, dtype=torch.float32, device=device)  # ones, not empty: touch every page
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        float(buffer.sum())
        best = min(best, time.perf_counter() - start)
    return nbytes / best


def load_runner(config: EngineConfig, tp: TPGroup | None = None) -> tuple[Checkpoint, ModelRunner]:
    """The checkpoint, and a runner around its model (this rank's slice of it) with the KV pool the plan allows."""
    ckpt = load_checkpoint(config.model, config.torch_dtype)
    positions = max(config.max_model_len or 0, ckpt.config.max_position_embeddings)
    calibration = calibration_ids(ckpt.path) if config.quantization == "int8" and tp is None else None
    model = Decoder(ckpt.config, ckpt.tensors, config.device, config.quantization, positions, tp,
                    fused_decode=config.fused_decode, calibration=calibration)
    plan = config.kv_plan(ckpt.config)
    if plan.num_blocks < 1:
        raise ValueError(f"kv_cache_memory {config.kv_cache_memory} holds no KV block")
    return ckpt, ModelRunner(model, config, plan.num_blocks, list(ckpt.config.eos_token_ids))


def calibration_ids(model_path: Path) -> list[int]:
    """A short fixed chat (prose, a list, code, a table, four languages) in the model's template: int8's
    smoothing factors are calibrated on it."""
    messages = json.loads((Path(__file__).parent / "calibration.json").read_text())
    return Tokenizer.load(model_path).encode_chat(messages)


class ModelRunner:
    def __init__(self, model: Decoder, config: EngineConfig, num_blocks: int, eos_ids: list[int]):
        c = model.config
        self.model, self.block_size, self.eos_ids = model, config.block_size, eos_ids
        self.num_blocks = num_blocks
        self.device = torch.device(config.device)
        # One preallocated pool: [layers, K/V, slots, kv_heads, head_dim], of this rank's KV heads (all of them
        # without tensor parallelism): every rank has the same blocks, each for its own heads.
        self.kv_cache = torch.zeros(c.num_layers, 2, num_blocks * config.block_size, model.num_kv_heads,
                                    c.head_dim, dtype=model.dtype, device=self.device)
        self.sampler = Sampler()

    def _tensor(self, data: list[int]) -> torch.Tensor:
        return torch.tensor(data, dtype=torch.long, device=self.device)

    def _slots(self, block_table: list[int], start: int, end: int) -> list[int]:
        bs = self.block_size
        return [block_table[p // bs] * bs + p % bs for p in range(start, end)]

    def _metadata(self, batch: list[ScheduledSeq], slot_mapping: list[int]) -> AttentionMetadata:
        """Batch must list its one-token items (decodes) first."""
        decodes = [s for s in batch if s.num_new_tokens == 1]
        bs = self.block_size
        if decodes:
            contexts = self._tensor([s.seq.num_computed_tokens + 1 for s in decodes])
            width = max(len(s.seq.block_table) for s in decodes)
            tables = self._tensor([s.seq.block_table + [0] * (width - len(s.seq.block_table)) for s in decodes])
            longest = int(contexts.max())
            slots = (tables[:, :, None] * bs + torch.arange(bs, device=self.device)).view(len(decodes), -1)
            decode_slots = slots[:, :longest].contiguous()
        else:
            decode_slots = contexts = torch.empty(0, device=self.device)
        prefills, start = [], len(decodes)
        for s in batch[len(decodes):]:
            done, n = s.seq.num_computed_tokens, s.num_new_tokens
            prefills.append(PrefillChunk(start, n, done + n, self._tensor(self._slots(s.seq.block_table, 0, done + n))))
            start += n
        return AttentionMetadata(self._tensor(slot_mapping), len(decodes), decode_slots, contexts,
                                 prefills)

    @torch.inference_mode()
    def execute(self, batch: list[ScheduledSeq]) -> StepResult:
        batch = sorted(batch, key=lambda s: s.num_new_tokens != 1)  # decodes first, order kept
        input_ids, positions, slot_mapping, sample_rows, prompt_rows = [], [], [], [], []
        for s in batch:
            seq, done, n = s.seq, s.seq.num_computed_tokens, s.num_new_tokens
            row = len(input_ids)
            input_ids += seq.token_ids[done:done + n]
            positions += range(done, done + n)
            slot_mapping += self._slots(seq.block_table, done, done + n)
            if seq.params.prompt_logprobs is not None and seq.index == 0 and done < seq.num_prompt_tokens:
                prompt_rows.append((s, row))
            if s.samples:
                sample_rows.append(row + n - 1)
        meta = self._metadata(batch, slot_mapping)
        ids, positions = self._tensor(input_ids), self._tensor(positions)
        sampling = [s for s in batch if s.samples]
        lens = [k for k, s in enumerate(sampling) if s.seq.probe is not None and s.seq.probe.lens_top]
        tap = LayerTap(self._tensor([sample_rows[k] for k in lens])) if lens else None
        # A step of decodes only (each samples its next token) can run as one fused call; a layer tap needs
        # the per-layer path.
        fusable = tap is None and not prompt_rows and len(sampling) == len(batch) == meta.num_decode_tokens
        logits = self.model.decode_step(ids, positions, meta, self.kv_cache) if fusable else None
        result = StepResult()
        if logits is None:
            hidden = self.model.forward(ids, positions, meta, self.kv_cache, tap)
            for s, row in prompt_rows:
                try:
                    result.prompt_logprobs[s.seq.seq_id] = self._prompt_logprobs(s, hidden[row:])
                except Exception as exc:
                    result.failed.append((s, exc))
            if not sampling:
                return result
            logits = self.model.logits(hidden[self._tensor(sample_rows)])
        probes = [k for k, s in enumerate(sampling) if s.seq.probe is not None]
        if probes:
            self._inspect(result, sampling, logits, probes, lens, tap)
            drawn = [k for k, s in enumerate(sampling) if s.seq.probe is None]
            sampling, logits = [sampling[k] for k in drawn], logits[self._tensor(drawn)]
            if not sampling:
                return result
        rows = [SamplingRow(s.seq.params, s.seq.output_token_ids, s.seq.prompt_token_ids, s.seq.generator,
                            self.eos_ids + s.seq.params.stop_token_ids, s.seq.grammar) for s in sampling]
        for item, outcome in zip(sampling, self._sample(logits, rows)):
            if isinstance(outcome, Exception):
                result.failed.append((item, outcome))
            else:
                result.sampled.append((item, *outcome))
        return result

    def _sample(self, logits: torch.Tensor,
                rows: list[SamplingRow]) -> list[tuple[int, dict[int, Logprob] | None] | Exception]:
        """Each row's token and logprobs, or the exception that row alone raises: when the batch fails,
        each row is sampled again on its own (with the same random draw) to find the culprits."""
        try:
            out = self.sampler(logits, rows)
        except Exception as exc:
            if len(rows) == 1:
                return [exc]
            return [outcome for i in range(len(rows)) for outcome in self._sample(logits[i:i + 1], rows[i:i + 1])]
        return list(zip(out.token_ids, out.logprobs or [None] * len(rows)))

    def _inspect(self, result: StepResult, sampling: list[ScheduledSeq], logits: torch.Tensor, probes: list[int],
                 lens: list[int], tap: LayerTap | None) -> None:
        """The probes' readings: their logits row, and per layer the lens's top tokens for those that asked;
        a probe whose reading raises fails alone."""
        for k in probes:
            item = sampling[k]
            try:
                inspection = Inspection(logits[k].clone())
                if k in lens:
                    assert tap is not None and item.seq.probe is not None
                    j = lens.index(k)
                    residual = torch.stack([layer[j] for layer in tap.residuals])
                    top = self.model.lens_logits(residual).log_softmax(-1).topk(item.seq.probe.lens_top, dim=-1)
                    inspection.lens = [LensLayer(ids, values)
                                       for ids, values in zip(top.indices.tolist(), top.values.tolist())]
                result.inspections.append((item, inspection))
            except Exception as exc:
                result.failed.append((item, exc))

    def _prompt_logprobs(self, item: ScheduledSeq, hidden: torch.Tensor) -> PromptLogprobs:
        """Each prompt token's logprob given those before it (+ the top k), for the tokens this chunk
        predicts; hidden starts at the chunk's first row. The very first token has no context: None."""
        seq, done = item.seq, item.seq.num_computed_tokens
        targets = seq.prompt_token_ids[done + 1:done + item.num_new_tokens + 1]
        entries: PromptLogprobs = [None] if done == 0 else []
        for start in range(0, len(targets), _PROMPT_ROWS):
            part = targets[start:start + _PROMPT_ROWS]
            logits = self.model.logits(hidden[start:start + len(part)])
            entries += token_logprobs(logits, part, seq.params.prompt_logprobs)
        return entries
