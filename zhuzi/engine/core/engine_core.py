"""The engine's step (EngineCore.step): schedule -> run the model and sample -> process the outputs
(stop checks, detokenizing, deltas) -> the scheduler's bookkeeping. EngineCoreProc (engine_core_proc.py) loops
over it; the offline LLM calls it itself."""
from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
import time
from collections import deque

import torch

from zhuzi.config import EngineConfig, SpeculativeConfig
from zhuzi.detokenizer import IncrementalDetokenizer
from zhuzi.engine.core.kv.services import KVServices
from zhuzi.engine.core.output_processor import OutputProcessor, RequestState
from zhuzi.engine.core.policies import make_policy
from zhuzi.engine.core.scheduler import Scheduler
from zhuzi.engine.core.spec_decode import DraftModelProposer, MTPProposer, NgramProposer, Proposer
from zhuzi.engine.messages import Handoff
from zhuzi.engine.sequence import Probe, ScheduledSeq, Sequence, StepOutcome, Tenant
from zhuzi.engine.thinking import ThoughtBudget
from zhuzi.engine.worker import tp_worker
from zhuzi.engine.worker.model_runner import StepResult, load_runner, measure_read_bandwidth
from zhuzi.engine.worker.tp_control import StepChannel
from zhuzi.model.loader import Checkpoint, model_name
from zhuzi.outputs import (
    EngineSnapshot,
    EngineStats,
    RequestMetrics,
    RequestOutput,
    SpecDecodingStats,
    StepRecord,
    StepRow,
)
from zhuzi.sample.grammar import shared_compiler
from zhuzi.sample.sampler import make_generator
from zhuzi.sampling_params import InvalidRequest, SamplingParams
from zhuzi.tokenizer import Tokenizer

log = logging.getLogger("zhuzi")
RECENT_STEPS = 256  # step records kept for snapshots


def check_token_ids(ids: list[int], vocab: int, param: str) -> None:
    """Every id must index the model's embedding and LM head (a Qwen vocabulary is larger than its
    tokenizer's: those extra ids are valid tokens that decode to nothing)."""
    if bad := [t for t in ids if not 0 <= t < vocab]:
        raise InvalidRequest(param, f"{param} holds token ids outside the vocabulary [0, {vocab}): {bad[:5]}")


class EngineCore:
    """Validates requests and runs steps. A fault stays with the request that caused it: a row whose sampling
    or bookkeeping raises fails its request alone (its output carries the error) while the rest of the batch
    goes on; a failure of the whole step (the forward pass) is retried once, then fails only that step's
    requests.

    With speculative decoding (EngineConfig.speculative_config) a proposer guesses each decoding sequence's
    next tokens after a step; the next step verifies them in the same forward pass as the rest of the batch,
    and the accepted ones plus one token of the target's own go through the stop checks one at a time.
    KV entries of rejected drafts sit beyond num_computed_tokens, where the next step overwrites them; a hybrid
    model's recurrent layers leave their state after each draft in a slot of its own, and the page manager keeps
    the one after the tokens that stand.
    Inspections (probes) are scheduled, prefix-cached and batched like any sequence, but at their last token
    the model is read out instead of sampled."""

    def __init__(self, config: EngineConfig, kv_events: bool = False, kv_transfers: bool = False):
        """kv_events: record the prefix-cache pages stored and evicted (pages.events), for a router;
        kv_transfers: take part in prefill/decode hand-offs (self.kv.handoffs)."""
        self.config = config
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        torch.manual_seed(config.seed)
        # With tensor parallelism this process is rank 0: it schedules and samples, the others follow.
        self.tp, self.workers = tp_worker.start(config)
        try:
            ckpt, self.runner = load_runner(config, self.tp)
        except BaseException:
            if self.tp is not None:  # nothing was posted yet: a fresh channel's first op is the stop
                tp_worker.stop(self.tp, StepChannel(self.tp), self.workers)
            raise
        self.model_config = ckpt.config
        self.model_path = ckpt.path
        self.tokenizer = Tokenizer.load(ckpt.path)
        self.max_model_len = config.max_model_len or ckpt.config.max_position_embeddings
        self.eos_ids = list(ckpt.config.eos_token_ids)
        spec = config.speculative
        max_positions = max(self.max_model_len, ckpt.config.max_position_embeddings)
        assert self.runner.kv_plan is not None
        self.kv_plan = plan = self.runner.kv_plan  # on a GPU, sized by its memory
        self.grammars = shared_compiler(self.tokenizer.hf, ckpt.config.vocab_size, self.eos_ids)
        self.pages, self.kv = KVServices.build(config, ckpt.config, ckpt.path, plan, self.runner.kv_cache,
                                                self.runner.num_pages, kv_events, kv_transfers,
                                                [t for layer in self.runner.states for t in layer])
        self.scheduler = Scheduler(self.pages, config.max_num_seqs, config.max_num_batched_tokens,
                                   config.long_prefill_token_threshold, spec.max_step_tokens if spec else 0,
                                   make_policy(config.scheduling_policy))
        self.spec = spec
        self.proposer: Proposer | None = None
        self.spec_stats: SpecDecodingStats | None = None
        if spec is not None:
            self.proposer = self._proposer(spec, ckpt, max_positions)
            self.spec_stats = SpecDecodingStats(num_accepted_tokens_per_pos=[0] * spec.num_speculative_tokens)
        self.output = OutputProcessor(self.tokenizer, self.eos_ids, self.max_model_len)
        self.requests: dict[str, RequestState] = {}
        self._seq_ids = itertools.count()
        self.recent_steps: deque[StepRecord] = deque(maxlen=RECENT_STEPS)
        self._step_count = itertools.count()
        log.info("model %s (%s, %s), %s, KV %d bytes/token, %d pages of %d = %d tokens%s", ckpt.path.name,
                 ckpt.config.architecture, config.precision, self.runner.model.placement, plan.bytes_per_token,
                 plan.num_pages, plan.page_size, plan.capacity_tokens,
                 f", tensor parallel over {self.tp.world_size} ranks" if self.tp else "")
        if plan.state_slots:
            log.info("recurrent state: %d slots of %d bytes (%d layers keep a state instead of KV)",
                     plan.state_slots, plan.state_bytes, ckpt.config.state_layers)
        log.info("CPU kernels: %s", ", ".join(f"{op} {path}" for op, path in self.kernel_paths.items()))

    def _proposer(self, spec: SpeculativeConfig, ckpt: Checkpoint, max_positions: int) -> Proposer:
        if spec.method == "ngram":
            return NgramProposer(spec)
        if spec.method == "mtp":
            if self.tp is not None:
                raise ValueError("speculative_config: mtp runs without tensor parallelism yet")
            self.runner.keep_hidden = True
            return MTPProposer(self.config, self.runner.model, ckpt.path, self.eos_ids, self.runner.num_pages,
                               max_positions)
        return DraftModelProposer(spec, self.config, self.tokenizer, self.eos_ids, ckpt.config.vocab_size,
                                  self.runner.num_pages, max_positions)

    def shutdown(self) -> None:
        """Write what the disk tier has queued; release the other tensor-parallel ranks."""
        if hasattr(self, "kv"):
            self.kv.close()
        if self.tp is not None:
            assert self.runner.channel is not None
            tp_worker.stop(self.tp, self.runner.channel, self.workers)
            self.tp = None

    @property
    def model_name(self) -> str:
        return model_name(self.model_path)

    @property
    def weight_bytes_per_decode_step(self) -> int:
        return self.runner.model.weight_bytes_per_decode_step

    @property
    def weight_format(self) -> str:
        """What the layers run on, resolved: gguf (a file's blocks), int8, int4 or none (dense)."""
        return self.runner.model.quantization or "none"

    @functools.cached_property
    def kernel_paths(self) -> dict[str, str]:
        return self.runner.model.kernel_paths()

    @property
    def kv_capacity_tokens(self) -> int:
        return self.pages.num_pages * self.pages.page_size

    # -- requests --------------------------------------------------------------------

    def check_token_ids(self, ids: list[int], param: str) -> None:
        check_token_ids(ids, self.model_config.vocab_size, param)

    def validate(self, prompt: str | list[int], params: SamplingParams) -> list[int]:
        """The prompt's ids, or InvalidRequest naming what the engine cannot run."""
        ids = self.tokenizer.encode_prompt(prompt)
        if not ids:
            raise InvalidRequest("prompt", "prompt is empty")
        self.check_token_ids(ids, "prompt")
        self.check_token_ids(list(params.logit_bias or {}), "logit_bias")
        self.check_token_ids(params.stop_token_ids, "stop_token_ids")
        self.check_token_ids(params.allowed_token_ids or [], "allowed_token_ids")
        params.tokenize_bad_words(lambda text: self.tokenizer.encode(text, add_special_tokens=False))
        self.scheduler.policy.check(params)
        if params.top_k > (vocab := self.model_config.vocab_size):
            raise InvalidRequest("top_k", f"top_k must be at most the vocabulary size {vocab}, got {params.top_k}")
        if params.structured_outputs is not None:
            self.grammars.matcher(params.structured_outputs)  # compiles (or finds) it: errors name the field
        total = len(ids) + (params.max_tokens or 1)
        if total > self.max_model_len:
            raise InvalidRequest(None, (
                f"This model's maximum context length is {self.max_model_len} tokens. However, you "
                f"requested {total} tokens ({len(ids)} in the prompt, {params.max_tokens or 1} for the "
                f"completion). Please reduce the length of the prompt or the completion."), "context_length_exceeded")
        if self.pages.pages_needed(self._kv_tokens(total)) > self.pages.num_pages - self.kv.pins.num_pages:
            raise InvalidRequest(None, (
                f"request needs {total} tokens of KV cache but the pool holds {self.kv_capacity_tokens} tokens, "
                f"{self.kv.pins.num_pages * self.pages.page_size} of them pinned; raise kv_cache_memory or "
                f"shorten the request"), "context_length_exceeded")
        return ids

    def _kv_tokens(self, total: int) -> int:
        """The KV slots a request of `total` tokens holds at most: all of them, or with a sliding window in every
        layer its window's pages and a step's chunk of prompt."""
        plan = self.kv_plan
        return total if plan.window is None else \
            min(total, plan.sequence_tokens(total) + self.config.max_num_batched_tokens)

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                    arrival_time: float | None = None, tenant: Tenant = Tenant(),
                    handoff: Handoff | None = None) -> None:
        """handoff: this request's part in a prefill/decode hand-off (kv/transfer.py)."""
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        ids = self.validate(prompt, params)
        seqs: list[Sequence] = []
        for i in range(params.n):
            seed = None if params.seed is None else params.seed + i
            leader = seqs[0] if seqs and self.config.enable_prefix_caching else None
            grammar = self.grammars.matcher(params.structured_outputs) if params.structured_outputs else None
            thought = ThoughtBudget.of(params, ids, self.tokenizer.think_ids)
            seqs.append(Sequence(next(self._seq_ids), request_id, i, ids, params, make_generator(seed), leader,
                                 grammar, thought=thought, tenant=tenant))
        req = RequestState(request_id, prompt if isinstance(prompt, str) else None, ids, params, seqs,
                           [IncrementalDetokenizer(self.tokenizer, params) for _ in seqs],
                           RequestMetrics(arrival_time or time.monotonic()), speculative=self.proposer is not None)
        if handoff is not None:
            self.kv.start_handoff(handoff, seqs)
        self.requests[request_id] = req
        for seq in seqs:
            self.scheduler.add(seq)

    def add_probe(self, request_id: str, token_ids: str | list[int], probe: Probe) -> None:
        """An inspection of token_ids (checked like a prompt): its final output carries what the model read
        at the last one. It shares the prefix cache, so re-reading a context the engine has seen is cheap."""
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        params = SamplingParams(max_tokens=1, temperature=0)
        ids = self.validate(token_ids, params)
        if probe.pin is not None:
            self.kv.pins.check(probe.pin, ids, "token_ids")
        seq = Sequence(next(self._seq_ids), request_id, 0, ids, params, probe=probe)
        self.requests[request_id] = RequestState(request_id, None, ids, params, [seq],
                                                 [IncrementalDetokenizer(self.tokenizer, params)],
                                                 RequestMetrics(time.monotonic()))
        self.scheduler.add(seq)

    def abort(self, request_id: str) -> RequestOutput | None:
        """End the request now, in whatever state it is, and free its pages. Its last output gives every
        sample still running finish_reason "abort" and the text held back so far."""
        req = self.requests.get(request_id)
        if req is None:
            return None
        for seq in self.output.abort(req):
            self.scheduler.finish(seq, "abort")
        return self._output(req)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def has_work(self) -> bool:
        """Whether a step would run something (a request awaiting its KV pages waits for a message)."""
        return bool(self.scheduler.running) or any(not s.awaiting_kv for s in self.scheduler.waiting)

    def stats(self) -> EngineStats:
        spec = self.spec_stats
        return EngineStats(len(self.scheduler.running), len(self.scheduler.waiting), self.pages.num_pages,
                           self.pages.num_free_pages, self.pages.prefix_queries, self.pages.prefix_hits,
                           None if spec is None else dataclasses.replace(
                               spec, num_accepted_tokens_per_pos=list(spec.num_accepted_tokens_per_pos)),
                           self.scheduler.tenant_loads(), **self.kv.stats())

    @functools.cached_property
    def read_bandwidth(self) -> float:
        """Bytes/s this device reads memory at; measured at the first call (on the step loop's thread,
        between two steps, so no forward pass shares the memory bus)."""
        return measure_read_bandwidth(self.config.device)

    def snapshot(self, num_steps: int) -> EngineSnapshot:
        """The engine's state and its last num_steps step records."""
        steps = list(self.recent_steps)[-num_steps:] if num_steps > 0 else []
        return EngineSnapshot(time.monotonic(), self.model_config, str(self.config.precision), self.kernel_paths,
                              self.max_model_len,
                              self.weight_bytes_per_decode_step, self.stats(), self.kv_plan, len(self.pages.cached),
                              self.read_bandwidth, steps, self.kv.pins.list(), self.kv.pins.limit_bytes)

    # -- the step --------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One forward pass for everything scheduled; returns the news of each touched request."""
        self.kv.tick()
        batch = self.scheduler.schedule()
        if not batch:
            return []
        start = time.monotonic()
        touched = {item.seq.request_id: self.requests[item.seq.request_id] for item in batch}
        try:
            result = self._execute(batch)
        except Exception as exc:  # failed twice: these requests end with the error; the engine goes on
            failed = StepOutcome()
            for req in touched.values():
                self.output.fail(req, exc, failed)
            for seq, reason, stop_reason in failed.finished:
                self.scheduler.finish(seq, reason, stop_reason)
            return [self._output(req) for req in touched.values()]
        now = time.monotonic()
        self.recent_steps.append(self._step_record(batch, result, now, now - start))
        outcome = self.output.process(batch, result, touched, start, now)
        for item, verdict in result.sampled:
            if item.spec_token_ids:
                self.spec_stats.observe(len(item.spec_token_ids), verdict.num_accepted)
        self.scheduler.update_from_output(batch, outcome)
        self._after_kv(result, touched)
        if isinstance(self.proposer, MTPProposer):
            self.proposer.observe(result.hidden)
        if self.proposer is not None:
            self._propose()
        return [self._output(req) for req in touched.values()]

    def _after_kv(self, result: StepResult, touched: dict[str, RequestState]) -> None:
        """Once the step's pages are in the prefix cache: prompts computed for a decode replica leave, pins
        whose probe has run hold their pages."""
        for item, _ in result.sampled:
            if touched[item.seq.request_id].error is None:
                self.kv.prompt_computed(item.seq)
        for item, _ in result.inspections:
            req = touched[item.seq.request_id]
            if item.seq.probe is not None and item.seq.probe.pin is not None and req.error is None:
                try:
                    req.pin = self.kv.pins.complete(item.seq)
                except InvalidRequest as exc:
                    self.output.fail(req, exc, StepOutcome())

    def _step_record(self, batch: list[ScheduledSeq], result: StepResult, end: float, duration: float) -> StepRecord:
        """Each row's share of the step, as the scheduler stamped it; called before the batch counts as computed."""
        accepted = {item.seq.seq_id: verdict.num_accepted for item, verdict in result.sampled}
        return StepRecord(next(self._step_count), end, duration, [
            StepRow(item.seq.request_id, item.kind, item.num_new_tokens, item.seq.num_computed_tokens
                    + item.num_new_tokens, len(item.spec_token_ids), accepted.get(item.seq.seq_id, 0))
            for item in batch])

    def _propose(self) -> None:
        """Drafts for the next step: each decoding sequence gets at most what the step could verify and
        what its max_tokens and the context window leave room for."""
        decoding = self.scheduler.decoding()
        room = min(self.spec.num_speculative_tokens, self.spec.max_step_tokens - len(decoding))
        seqs, limits = [], []
        for seq in self.scheduler.running:
            seq.spec_token_ids, seq.spec_probs = [], None
        for seq in decoding:
            if (k := min(room, seq.max_length(self.max_model_len) - seq.num_tokens - 1)) > 0:  # emits up to k + 1
                seqs.append(seq)
                limits.append(k)
        if seqs:
            self.proposer.propose(seqs, limits)

    def _execute(self, batch: list[ScheduledSeq]) -> StepResult:
        """Run the step; a failure of the whole step (not of one row: the runner keeps those apart) may be
        passing, so the step is tried once more before its requests give up."""
        try:
            return self.runner.execute(batch)
        except Exception:
            log.exception("a step of %d sequences failed; trying it once more", len(batch))
            return self.runner.execute(batch)

    def _output(self, req: RequestState) -> RequestOutput:
        """The request's news since its last output; a finished request leaves the engine."""
        out = self.output.output(req)
        if out.finished:
            if self.proposer is not None:
                for seq in req.seqs:
                    self.proposer.release(seq)
            del self.requests[req.request_id]
        return out
