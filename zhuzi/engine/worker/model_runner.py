"""The model runner, the worker's part of a step: owns the KV pool, turns a scheduled step into tensors,
runs the forward pass, then the sampler (or the verification of speculative drafts); prompt logprobs, probe
readings and pooled embeddings come from the same pass."""
from __future__ import annotations

import contextlib
import ctypes
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from zhuzi.config import EngineConfig, GPUPlan, KVPlan
from zhuzi.engine.sequence import ScheduledSeq, Sequence
from zhuzi.engine.worker.model_builder import build_model
from zhuzi.engine.worker.tp_control import FORWARD, LOGITS, StepChannel, pack_step
from zhuzi.model import native
from zhuzi.model.attention import AttentionMetadata, PrefillChunk
from zhuzi.model.decoder import Decoder, LayerTap
from zhuzi.model.kv_pool import KVPool, zeroed
from zhuzi.model.loader import Checkpoint
from zhuzi.model.parallel import TPRank
from zhuzi.model.recurrent import StateRun
from zhuzi.outputs import Inspection, LensLayer, Logprob
from zhuzi.sample.rejection import Draft, verify
from zhuzi.sample.sampler import Sampler, SamplingRow, Verdict, token_logprobs

# Prompt logprobs are computed this many positions at a time, so a long chunk never needs a
# second [tokens, vocab] tensor of logits.
_PROMPT_ROWS = 256

PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass
class StepResult:
    sampled: list[tuple[ScheduledSeq, Verdict]] = field(default_factory=list)
    # seq_id -> entries of the prompt tokens this chunk predicts
    prompt_logprobs: dict[int, PromptLogprobs] = field(default_factory=dict)
    failed: list[tuple[ScheduledSeq, Exception]] = field(default_factory=list)  # rows that failed alone
    inspections: list[tuple[ScheduledSeq, Inspection]] = field(default_factory=list)  # probes that reached their end
    # With keep_hidden: each sequence's final hidden states of its rows, from the first row's position on
    hidden: list[tuple[Sequence, int, torch.Tensor]] = field(default_factory=list)


def measure_read_bandwidth(device: str | torch.device = "cpu", nbytes: int = 256 << 20, repeats: int = 5) -> float:
    """Bytes/s of the fastest of `repeats` full reads of a buffer larger than any cache: on CPU STREAM's way
    (kernels/stream.cpp: every thread its own slice, vector loads), elsewhere (or without the kernels) one
    torch.sum, which reads slower than the threads can (docs/cpu.md)."""
    buffer = torch.ones(nbytes // 4, dtype=torch.float32, device=device)  # ones, not empty: touch every page
    fn = native.entry("stream", "zhuzi_stream_read", [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_int,
                                                      ctypes.c_void_p, ctypes.c_void_p]) \
        if buffer.is_cpu else None
    if fn is not None:
        seconds, total = ctypes.c_double(), ctypes.c_float()
        if fn(buffer.data_ptr(), buffer.numel(), repeats, torch.get_num_threads(), ctypes.byref(seconds),
              ctypes.byref(total)) == 0:
            return nbytes / seconds.value
    return torch_sum_bandwidth(buffer, repeats)


def torch_sum_bandwidth(buffer: torch.Tensor, repeats: int) -> float:
    """Bytes/s of the fastest of `repeats` torch.sum over buffer."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        float(buffer.sum())
        best = min(best, time.perf_counter() - start)
    return buffer.nbytes / best


@contextlib.contextmanager
def out_of_memory(what: str, fix: str) -> Iterator[None]:
    """An accelerator's out-of-memory error inside, as one line naming what did not fit and the flag that fixes
    it: a ValueError, which a load reports in one line (as a setting that does not fit) and a step as its
    requests' error."""
    try:
        yield
    except torch.OutOfMemoryError as exc:
        said = f" ({str(exc).splitlines()[0]})" if str(exc) else ""
        raise ValueError(f"out of GPU memory: {what} did not fit; {fix}{said}") from None


def _gpu_memory(config: EngineConfig, ckpt: Checkpoint) -> GPUPlan | None:
    """The GPU's share, measured now that the weights are on it (None: no layer that keeps KV on a CUDA device)."""
    placement = config.placement(ckpt.config)
    if placement.accelerator.type != "cuda" or not placement.gpu_layers:
        return None
    total = torch.cuda.get_device_properties(placement.accelerator).total_memory
    gpu = config.gpu_plan(ckpt.config, total, torch.cuda.memory_allocated(placement.accelerator))
    if gpu is not None:
        gpu.check(config.page_size, placement.gpu_layers)
    return gpu


def load_runner(config: EngineConfig, tp: TPRank | None = None) -> tuple[Checkpoint, ModelRunner]:
    """The checkpoint, and a runner around its model (this rank's slice of it) with the KV pool the plan allows:
    --kv-cache-memory's, or on a GPU the share of its memory --gpu-memory-utilization leaves."""
    native.select(config.cpu_kernels)
    if torch.device(config.device).type == "cuda" and config.n_gpu_layers and not torch.cuda.is_available():
        raise ValueError(f"--device {config.device}: torch sees no CUDA device here (torch.cuda.is_available() is "
                         "false); --device cpu runs on the CPU")
    with out_of_memory("the weights", "lower --n-gpu-layers (the rest of the layers stay on the CPU)"):
        ckpt, model = build_model(config, config.model, tp)
    plan = config.kv_plan(ckpt.config, _gpu_memory(config, ckpt))
    if plan.num_pages < 1:
        raise ValueError(f"kv_cache_memory {config.kv_cache_memory} holds no KV page")
    if plan.state_bytes and plan.state_slots < plan.sequence_slots:
        raise ValueError(f"kv_cache_memory {config.kv_cache_memory} holds no recurrent state of a sequence "
                         f"({plan.state_bytes:,} bytes, {plan.sequence_slots} per running sequence, in at most "
                         "half of it)")
    pooling = config.pooling or ckpt.config.pooling or "mean"
    with out_of_memory(f"the KV pool ({plan.num_pages} pages)", "lower --gpu-memory-utilization"):
        runner = ModelRunner(model, config, plan.num_pages, list(ckpt.config.eos_token_ids), pooling,
                             plan.state_slots, plan)
    return ckpt, runner


def _one_token_rows_first(batch: list[ScheduledSeq]) -> list[int]:
    """The order of the batch's rows with its one-token rows first, order kept: the attention takes them as
    one batch of single queries, whatever their kind (a prompt's last token alone is one)."""
    return sorted(range(len(batch)), key=lambda i: batch[i].num_new_tokens != 1)


class ModelRunner:
    """Runs steps of one model over its KV pool. A sequence's drafts ride in the same pass as the rest of the
    batch: its last token and k drafts are k + 1 new tokens, laid out as a prefill chunk (each row attends to
    the history up to its own position, with a decode row's arithmetic), and all k + 1 rows get logits for
    the verifier."""

    def __init__(self, model: Decoder, config: EngineConfig, num_pages: int, eos_ids: list[int],
                 pooling: str = "mean", state_slots: int = 0, kv_plan: KVPlan | None = None):
        self.model, self.page_size, self.eos_ids, self.pooling = model, config.page_size, eos_ids, pooling
        self.num_pages = num_pages
        self.device = model.placement.ends  # a step's inputs and logits (a layer split's other side: decoder.py)
        # One preallocated pool (kv_pool.py), of this rank's KV heads (all of them without tensor parallelism):
        # every rank has the same pages, each for its own heads; each layer's pages on its device.
        self.kv_cache = KVPool.zeros(model.kv_shape, num_pages * config.page_size, config.precision.kv, self.device)
        # A hybrid model's state pool: per recurrent layer its states, [slots, ...] each, float32
        self.states = [[zeroed((state_slots, *shape), torch.float32, device) for shape in shapes]
                       for shapes, device in zip(model.state_shapes(), model.state_devices())]
        self.kv_plan = kv_plan  # the pool's arithmetic, where load_runner made it
        self.sampler = Sampler()
        # With tensor parallelism this is rank 0's runner: it posts each forward pass and LM-head call, which the
        # other ranks' follow loops (tp_worker.py) run over their slices.
        self.channel = StepChannel(model.tp) if model.tp else None
        self.keep_hidden = False  # hand each step's final hidden states out (StepResult.hidden), for an MTP proposer

    def _posted(self, op: str, payload: Callable[[], torch.Tensor]) -> contextlib.AbstractContextManager:
        """Rank 0 runs its share of op inside this (the followers are told first); without ranks, nothing."""
        return self.channel.posted(op, payload()) if self.channel else contextlib.nullcontext()

    def _forward(self, ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                 tap: LayerTap | None = None) -> torch.Tensor:
        with self._posted(FORWARD, lambda: pack_step(ids, positions, meta)):
            return self.model.forward(ids, positions, meta, self.kv_cache, tap, self.states)

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        with self._posted(LOGITS, lambda: hidden):
            return self.model.logits(hidden)

    def _tensor(self, data: list[int]) -> torch.Tensor:
        return torch.tensor(data, dtype=torch.long, device=self.device)

    def _slots(self, page_table: list[int], start: int, end: int) -> list[int]:
        size = self.page_size
        return [page_table[p // size] * size + p % size for p in range(start, end)]

    def _metadata(self, batch: list[ScheduledSeq], slot_mapping: list[int]) -> AttentionMetadata:
        """Batch must list its one-token rows first (_one_token_rows_first)."""
        decodes = [s for s in batch if s.num_new_tokens == 1]
        size = self.page_size
        if decodes:
            contexts = self._tensor([s.seq.num_computed_tokens + 1 for s in decodes])
            width = max(len(s.seq.page_table) for s in decodes)
            tables = self._tensor([s.seq.page_table + [0] * (width - len(s.seq.page_table)) for s in decodes])
            longest = int(contexts.max())
            slots = (tables[:, :, None] * size + torch.arange(size, device=self.device)).view(len(decodes), -1)
            decode_slots = slots[:, :longest].contiguous()
        else:
            decode_slots = contexts = torch.empty(0, device=self.device)
        prefills, start = [], len(decodes)
        for s in batch[len(decodes):]:
            done, n = s.seq.num_computed_tokens, s.num_new_tokens
            prefills.append(PrefillChunk(start, n, done + n, self._tensor(self._slots(s.seq.page_table, 0, done + n))))
            start += n
        return AttentionMetadata(self._tensor(slot_mapping), len(decodes), decode_slots, contexts,
                                 prefills, self._state_runs(batch))

    def _state_runs(self, batch: list[ScheduledSeq]) -> list[StateRun]:
        """A hybrid model's sequences in the state pool: a new sequence starts from zeros, a resumed one from its
        cached state; a run that crosses a page boundary leaves its state at the last one in its boundary slot. A
        verify leaves its state after each draft in a draft slot, and at a page boundary in the last draft slot
        (the page manager's _keep_verified_states gives them their roles once the verdict is known)."""
        if not self.states:
            return []
        runs, start = [], 0
        for s in batch:
            seq, done, n, k = s.seq, s.seq.num_computed_tokens, s.num_new_tokens, len(s.spec_token_ids)
            assert seq.state_slot is not None
            boundary = seq.state_boundary(done + n, self.page_size)
            snapshots = [(j + 1, seq.draft_slots[j]) for j in range(k)]
            if seq.boundary_slot is not None and boundary > done:
                snapshots.append((boundary - done, seq.draft_slots[-1] if k else seq.boundary_slot))
            runs.append(StateRun(start, n, seq.state_slot, tuple(snapshots), seq.restore_slot,
                                 fresh=done == 0 and seq.restore_slot is None))
            start += n
        return runs

    def _inputs(self, batch: list[ScheduledSeq]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
        """A step's token ids, positions and attention metadata (one-token rows first), and each item's first row."""
        input_ids, positions, slot_mapping, starts = [], [], [], []
        for s in batch:
            seq, done, n = s.seq, s.seq.num_computed_tokens, s.num_new_tokens
            starts.append(len(input_ids))
            input_ids += seq.token_ids[done:done + n - len(s.spec_token_ids)] + s.spec_token_ids
            positions += range(done, done + n)
            slot_mapping += self._slots(seq.page_table, done, done + n)
        return self._tensor(input_ids), self._tensor(positions), self._metadata(batch, slot_mapping), starts

    @torch.inference_mode()
    def execute(self, batch: list[ScheduledSeq]) -> StepResult:
        tokens = sum(s.num_new_tokens for s in batch)
        with out_of_memory(f"a step of {tokens} tokens", "lower --max-num-batched-tokens or "
                                                          "--gpu-memory-utilization"):
            return self._execute(batch)

    def _execute(self, batch: list[ScheduledSeq]) -> StepResult:
        batch = [batch[i] for i in _one_token_rows_first(batch)]
        lens = [s for s in batch if s.samples and s.seq.probe is not None and s.seq.probe.lens_top]
        ids, positions, meta, starts = self._inputs(batch)
        prompt_rows = [(s, row) for s, row in zip(batch, starts) if s.seq.params.prompt_logprobs is not None
                       and s.seq.index == 0 and not s.seq.prompt_done]
        # A step whose rows each sample from one new token can run as one fused call (the model takes it when
        # no row is wider: a verify is not), whose logits row i is item i's. A step with a probe takes the
        # per-layer path, where the logit lens taps: with the lens or without, a probe reads the same bits.
        fusable = not prompt_rows and not self.keep_hidden and all(s.samples and s.seq.probe is None for s in batch)
        fused = self.model.decode_step(ids, positions, meta, self.kv_cache) if fusable else None
        result = StepResult()
        if fused is not None:
            def read(rows: list[int]) -> torch.Tensor:
                return fused[self._tensor(rows)]
            tap = None
        else:
            last = {id(s): start + s.num_new_tokens - 1 for s, start in zip(batch, starts)}
            tap = LayerTap(self._tensor([last[id(s)] for s in lens])) if lens else None
            hidden = self._forward(ids, positions, meta, tap)

            def read(rows: list[int]) -> torch.Tensor:
                return self._logits(hidden[self._tensor(rows)])
            for s, row in prompt_rows:
                try:
                    result.prompt_logprobs[s.seq.seq_id] = self._prompt_logprobs(s, hidden[row:])
                except Exception as exc:
                    result.failed.append((s, exc))
            for s, row in zip(batch, starts):
                if s.seq.embeds:
                    self._pool(result, s, hidden[row:row + s.num_new_tokens])
                elif self.keep_hidden and s.seq.probe is None:
                    result.hidden.append((s.seq, s.seq.num_computed_tokens, hidden[row:row + s.num_new_tokens]))
        sampling = [(s, row) for s, row in zip(batch, starts) if s.samples and not s.seq.embeds]
        probes = [(s, row) for s, row in sampling if s.seq.probe is not None]
        if probes:
            logits = read([row + s.num_new_tokens - 1 for s, row in probes])
            self._inspect(result, [s for s, _ in probes], logits, list(range(len(probes))),
                          [k for k, (s, _) in enumerate(probes) if s.seq.probe.lens_top], tap)
            sampling = [(s, row) for s, row in sampling if s.seq.probe is None]
        if not sampling:
            return result
        # The last row of a plain item; the k + 1 rows of an item with k drafts.
        logits = read([r for s, row in sampling for r in range(row + s.num_new_tokens - len(s.spec_token_ids) - 1,
                                                                 row + s.num_new_tokens)])
        drafts = [self._draft(s) for s, _ in sampling]
        for (item, _), outcome in zip(sampling, self._decide(logits, drafts)):
            if isinstance(outcome, Exception):
                result.failed.append((item, outcome))
            else:
                result.sampled.append((item, outcome))
        return result

    @torch.inference_mode()
    def last_logits(self, batch: list[ScheduledSeq]) -> torch.Tensor:
        """[len(batch), V]: the logits after each item's last new token (a draft model's forward pass)."""
        return self._logits(self.last_hidden(batch))

    @torch.inference_mode()
    def last_hidden(self, batch: list[ScheduledSeq], inputs: list[torch.Tensor] | None = None) -> torch.Tensor:
        """[len(batch), hidden]: the final hidden state at each item's last new token; inputs: each item's rows of
        what the model takes beside the tokens (an MTP layer's hidden states)."""
        order = _one_token_rows_first(batch)
        ids, positions, meta, starts = self._inputs([batch[i] for i in order])
        if inputs is None:
            hidden = self._forward(ids, positions, meta)
        else:
            beside = torch.cat([inputs[i] for i in order])
            hidden = self.model.forward(ids, positions, meta, self.kv_cache, hidden=beside)
        rows = [0] * len(batch)
        for i, start in zip(order, starts):
            rows[i] = start + batch[i].num_new_tokens - 1
        return hidden[self._tensor(rows)]

    def _draft(self, item: ScheduledSeq) -> Draft:
        seq, k = item.seq, len(item.spec_token_ids)
        row = SamplingRow(seq.params, seq.output_token_ids, seq.prompt_token_ids, seq.generator,
                          self.eos_ids + seq.params.stop_token_ids, seq.grammar)
        probs = seq.spec_probs[:k] if k and seq.spec_probs is not None else None
        return Draft(row, item.spec_token_ids, probs)

    def _decide(self, logits: torch.Tensor, drafts: list[Draft]) -> list[Verdict | Exception]:
        """Each sequence's verdict: the sampler's token, or, when drafts ride along, the verifier's; or the
        exception that sequence alone raises: when the batch fails, each is decided again on its own (with the
        same random draws) to find the culprits."""
        try:
            if any(d.k for d in drafts):
                return verify(logits, drafts)
            return self.sampler(logits, [d.row for d in drafts]).verdicts()
        except Exception as exc:
            if len(drafts) == 1:
                return [exc]
            out, start = [], 0
            for d in drafts:
                out += self._decide(logits[start:start + d.k + 1], [d])
                start += d.k + 1
            return out

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
                    lens = self._logits(self.model.final_norm(residual))
                    top = lens.log_softmax(-1).topk(item.seq.probe.lens_top, dim=-1)
                    inspection.lens = [LensLayer(ids, values)
                                       for ids, values in zip(top.indices.tolist(), top.values.tolist())]
                result.inspections.append((item, inspection))
            except Exception as exc:
                result.failed.append((item, exc))

    def _pool(self, result: StepResult, item: ScheduledSeq, hidden: torch.Tensor) -> None:
        """An embedding's chunk of final hidden states: added to its sum (mean pooling), and at its last token
        read out, pooled and L2-normalized; a failure fails that embedding alone."""
        seq, done = item.seq, item.seq.num_computed_tokens
        try:
            if self.pooling == "mean" and (done == 0 or (seq.pooled is not None and seq.pooled[0] == done)):
                # Added one token at a time, in order (a sequential scan): the sum does not depend on how the
                # prompt was cut into chunks, so pooling adds no difference of its own between a batch and alone.
                start = hidden.new_zeros(1, hidden.shape[-1], dtype=torch.float32) if done == 0 else seq.pooled[1]
                total = torch.cat([start.view(1, -1), hidden.float()]).cumsum(0)[-1]
                seq.pooled = (done + item.num_new_tokens, total)  # done 0: the first chunk, or again after preemption
            if item.samples:
                state = hidden[-1].float() if self.pooling == "last" else seq.pooled[1] / seq.num_prompt_tokens
                embedding = torch.nn.functional.normalize(state, dim=0).cpu()
                result.inspections.append((item, Inspection(embedding=embedding)))
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
            logits = self._logits(hidden[start:start + len(part)])
            entries += token_logprobs(logits, part, seq.params.prompt_logprobs)
        return entries
