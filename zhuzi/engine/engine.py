"""The step loop: schedule -> run the model -> sample -> detokenize -> stop checks -> outputs.

A fault stays with the request that caused it: a row whose sampling or bookkeeping raises fails
its request alone (its output carries the error) while the rest of the batch goes on; a failure of
the whole step (the forward pass) is retried once, and then fails only that step's requests.

With speculative decoding (EngineConfig.speculative_config) a proposer guesses each decoding sequence's
next tokens at the end of a step; the next step verifies them in the same forward pass as the rest of
the batch and emits the accepted ones plus one token of the target's own, one at a time through the
same stop checks: nothing after a stop string, stop token or max_tokens is emitted. KV entries of
rejected drafts sit beyond num_computed_tokens, where the next step overwrites them.

A constrained request (SamplingParams.structured_outputs) gets one grammar matcher per sequence;
the sampler masks with it, each sampled token advances it, and the sequence ends ("stop") the
moment its grammar does: that end wins over min_tokens and ignore_eos. Stop strings and max_tokens
still cut the output short, as they do any other ("length" may leave an object unfinished).

Inspections (probes) take the same loop: a probe is a sequence that is scheduled, prefix-cached and
batched like any other, but at its last token the model is read out instead of sampled.
"""
from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from zhuzi.config import EngineConfig
from zhuzi.detokenizer import IncrementalDetokenizer
from zhuzi.engine import tp_worker
from zhuzi.engine.block_manager import BlockManager, KVEvents
from zhuzi.engine.model_runner import PromptLogprobs, StepResult, load_runner, measure_read_bandwidth
from zhuzi.engine.scheduler import Scheduler
from zhuzi.engine.sequence import Probe, ScheduledSeq, Sequence
from zhuzi.engine.spec_decode import DraftModelProposer, NgramProposer, Proposer
from zhuzi.engine.structured import GrammarCompiler
from zhuzi.outputs import (
    CompletionOutput,
    EngineSnapshot,
    EngineStats,
    Inspection,
    Logprob,
    RequestMetrics,
    RequestOutput,
    SpecDecodingStats,
    StepRecord,
    StepRow,
)
from zhuzi.rejection_sampler import Verdict
from zhuzi.sampler import make_generator
from zhuzi.sampling_params import InvalidRequest, SamplingParams
from zhuzi.tokenizer import Tokenizer

log = logging.getLogger("zhuzi")
RECENT_STEPS = 256  # step records kept for snapshots


def check_token_ids(ids: list[int], vocab: int, param: str) -> None:
    """Every id must index the model's embedding and LM head (a Qwen vocabulary is larger than its
    tokenizer's: those extra ids are valid tokens that decode to nothing)."""
    if bad := [t for t in ids if not 0 <= t < vocab]:
        raise InvalidRequest(param, f"{param} holds token ids outside the vocabulary [0, {vocab}): {bad[:5]}")


@dataclass
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    detokenizers: list[IncrementalDetokenizer]
    metrics: RequestMetrics
    prompt_logprobs: PromptLogprobs | None = None  # complete once the prompt is computed
    partial_prompt_logprobs: PromptLogprobs = field(default_factory=list)
    deltas: dict[int, CompletionOutput] = field(default_factory=dict)  # news since the last output
    error: str | None = None  # why the engine failed this request
    inspection: Inspection | None = None  # a probe's reading, once its last token ran

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.seqs)

    @property
    def wants_logprobs(self) -> bool:
        return self.params.logprobs is not None


class Engine:
    def __init__(self, config: EngineConfig, kv_events: bool = False):
        """kv_events: record the prefix-cache blocks stored and evicted (blocks.events), for a router."""
        self.config = config
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        torch.manual_seed(config.seed)
        # With tensor parallelism this process is rank 0: it schedules and samples, the others follow.
        self.tp, self.workers = tp_worker.start(config)
        try:
            ckpt, self.runner = load_runner(config, self.tp)
        except BaseException:
            self.shutdown()
            raise
        self.model_config = ckpt.config
        self.model_path = ckpt.path
        self.tokenizer = Tokenizer.load(ckpt.path)
        self.max_model_len = config.max_model_len or ckpt.config.max_position_embeddings
        self.eos_ids = list(ckpt.config.eos_token_ids)
        spec = config.speculative
        max_positions = max(self.max_model_len, ckpt.config.max_position_embeddings)
        self.kv_plan = plan = config.kv_plan(ckpt.config)
        self.grammars = GrammarCompiler(self.tokenizer.hf, ckpt.config.vocab_size, self.eos_ids)
        self.blocks = BlockManager(self.runner.num_blocks, config.block_size, config.enable_prefix_caching,
                                   events=KVEvents() if kv_events else None)
        self.scheduler = Scheduler(self.blocks, config.max_num_seqs, config.max_num_batched_tokens,
                                   config.long_prefill_token_threshold, spec.max_step_tokens if spec else 0)
        self.spec = spec
        self.proposer: Proposer | None = None
        self.spec_stats: SpecDecodingStats | None = None
        if spec is not None:
            self.proposer = NgramProposer(spec) if spec.method == "ngram" else DraftModelProposer(
                spec, config, self.tokenizer, self.eos_ids, ckpt.config.vocab_size, self.runner.num_blocks,
                max_positions)
            self.spec_stats = SpecDecodingStats(num_accepted_tokens_per_pos=[0] * spec.num_speculative_tokens)
        self.requests: dict[str, Request] = {}
        self._seq_ids = itertools.count()
        self.recent_steps: deque[StepRecord] = deque(maxlen=RECENT_STEPS)
        self._step_count = itertools.count()
        log.info("model %s (%s, %s), KV %d bytes/token, %d blocks of %d = %d tokens%s", ckpt.path.name,
                 ckpt.config.architecture, config.dtype, plan.bytes_per_token, plan.num_blocks, plan.block_size,
                 plan.capacity_tokens, f", tensor parallel over {self.tp.world_size} ranks" if self.tp else "")

    def shutdown(self) -> None:
        """Release the other tensor-parallel ranks (nothing to do without them)."""
        if self.tp is not None:
            tp_worker.stop(self.tp, self.workers)
            self.tp = None

    @property
    def model_name(self) -> str:
        """The name clients know the model by: its directory's, or its file's without the extension."""
        path = self.model_path
        return path.name.split(".")[0] if path.is_file() else path.name

    @property
    def weight_bytes_per_decode_step(self) -> int:
        return self.runner.model.weight_bytes_per_decode_step

    @property
    def kv_capacity_tokens(self) -> int:
        return self.blocks.num_blocks * self.blocks.block_size

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
        if self.blocks.blocks_needed(total) > self.blocks.num_blocks:
            raise InvalidRequest(None, (
                f"request needs {total} tokens of KV cache but the whole pool holds "
                f"{self.kv_capacity_tokens} tokens; raise kv_cache_memory or shorten the request"),
                "context_length_exceeded")
        return ids

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                    arrival_time: float | None = None) -> None:
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        ids = self.validate(prompt, params)
        seqs: list[Sequence] = []
        for i in range(params.n):
            seed = None if params.seed is None else params.seed + i
            leader = seqs[0] if seqs and self.config.enable_prefix_caching else None
            grammar = self.grammars.matcher(params.structured_outputs) if params.structured_outputs else None
            seqs.append(Sequence(next(self._seq_ids), request_id, i, ids, params, make_generator(seed), leader,
                                 grammar))
        req = Request(request_id, prompt if isinstance(prompt, str) else None, ids, params, seqs,
                      [IncrementalDetokenizer(self.tokenizer, params) for _ in seqs],
                      RequestMetrics(arrival_time or time.monotonic()))
        self.requests[request_id] = req
        for seq in seqs:
            self.scheduler.add(seq)

    def add_probe(self, request_id: str, token_ids: list[int], probe: Probe) -> None:
        """An inspection of token_ids (checked like a prompt): its final output carries what the model read
        at the last one. It shares the prefix cache, so re-reading a context the engine has seen is cheap."""
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        params = SamplingParams(max_tokens=1, temperature=0)
        ids = self.validate(token_ids, params)
        seq = Sequence(next(self._seq_ids), request_id, 0, ids, params, probe=probe)
        self.requests[request_id] = Request(request_id, None, ids, params, [seq],
                                            [IncrementalDetokenizer(self.tokenizer, params)],
                                            RequestMetrics(time.monotonic()))
        self.scheduler.add(seq)

    def abort(self, request_id: str) -> RequestOutput | None:
        """End the request now, in whatever state it is, and free its blocks. Its last output gives every
        sample still running finish_reason "abort" and the text held back so far."""
        req = self.requests.get(request_id)
        if req is None:
            return None
        for seq in req.seqs:
            if not seq.finished:
                delta = req.deltas.setdefault(seq.index, CompletionOutput.empty(seq.index, req.wants_logprobs))
                delta.text += req.detokenizers[seq.index].flush()
                self.scheduler.finish(seq, "abort")
        return self._output(req)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def stats(self) -> EngineStats:
        spec = self.spec_stats
        return EngineStats(len(self.scheduler.running), len(self.scheduler.waiting), self.blocks.num_blocks,
                           self.blocks.num_free_blocks, self.blocks.prefix_queries, self.blocks.prefix_hits,
                           None if spec is None else dataclasses.replace(
                               spec, num_accepted_tokens_per_pos=list(spec.num_accepted_tokens_per_pos)))

    @functools.cached_property
    def read_bandwidth(self) -> float:
        """Bytes/s this device reads memory at; measured at the first call (on the step loop's thread,
        between two steps, so no forward pass shares the memory bus)."""
        return measure_read_bandwidth(self.config.device)

    def snapshot(self, num_steps: int) -> EngineSnapshot:
        """The engine's state and its last num_steps step records."""
        steps = list(self.recent_steps)[-num_steps:] if num_steps > 0 else []
        return EngineSnapshot(time.monotonic(), self.model_config, self.config.dtype, self.max_model_len,
                              self.weight_bytes_per_decode_step, self.stats(), self.kv_plan, len(self.blocks.cached),
                              self.read_bandwidth, steps)

    # -- the step --------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One forward pass for everything scheduled; returns the news of each touched request."""
        batch = self.scheduler.schedule()
        if not batch:
            return []
        start = time.monotonic()
        touched = {item.seq.request_id: self.requests[item.seq.request_id] for item in batch}
        try:
            result = self._execute(batch)
        except Exception as exc:  # failed twice: these requests end with the error; the engine goes on
            for req in touched.values():
                self._fail(req, exc)
            return [self._output(req) for req in touched.values()]
        now = time.monotonic()
        self.recent_steps.append(self._step_record(batch, result, now, now - start))
        failed = {item.seq.request_id: exc for item, exc in result.failed}
        for item in batch:
            seq, req = item.seq, touched[item.seq.request_id]
            req.metrics.first_scheduled_time = req.metrics.first_scheduled_time or start
            if seq.seq_id in result.prompt_logprobs and req.request_id not in failed:
                try:
                    self._collect_prompt_logprobs(req, seq, result.prompt_logprobs[seq.seq_id])
                except Exception as exc:
                    failed[req.request_id] = exc
            samples = item.samples
            seq.num_computed_tokens += item.num_new_tokens - len(item.spec_token_ids)  # drafts count once accepted
            if not samples:
                self.blocks.register_computed(seq)
        for item, verdict in result.sampled:
            req = touched[item.seq.request_id]
            if item.spec_token_ids:
                self.spec_stats.observe(len(item.spec_token_ids), verdict.num_accepted)
            if req.request_id not in failed:
                try:
                    self._append_tokens(req, item, verdict, now, now - start)
                except Exception as exc:
                    failed[req.request_id] = exc
        for item, inspection in result.inspections:
            if item.seq.request_id not in failed:
                touched[item.seq.request_id].inspection = inspection
                self.scheduler.finish(item.seq, "stop")
        for request_id, exc in failed.items():
            self._fail(touched[request_id], exc)
        if self.proposer is not None:
            self._propose()
        return [self._output(req) for req in touched.values()]

    def _step_record(self, batch: list[ScheduledSeq], result: StepResult, end: float, duration: float) -> StepRecord:
        """Each row's share of the step; called before the batch counts as computed (ScheduledSeq.kind)."""
        accepted = {item.seq.seq_id: verdict.num_accepted for item, verdict in result.sampled}
        return StepRecord(next(self._step_count), end, duration, [
            StepRow(item.seq.request_id, item.kind, item.num_new_tokens, item.seq.num_computed_tokens
                    + item.num_new_tokens, len(item.spec_token_ids), accepted.get(item.seq.seq_id, 0))
            for item in batch])

    def _propose(self) -> None:
        """Drafts for the next step: each decoding sequence gets at most what the step could verify and
        what its max_tokens and the context window leave room for."""
        decoding = [s for s in self.scheduler.running if s.prompt_done and s.num_tokens - s.num_computed_tokens == 1]
        room = min(self.spec.num_speculative_tokens, self.spec.max_step_tokens - len(decoding))
        seqs, limits = [], []
        for seq in self.scheduler.running:
            seq.spec_token_ids, seq.spec_probs = [], None
        for seq in decoding:
            p = seq.params
            limit = min(seq.num_prompt_tokens + p.max_tokens if p.max_tokens else self.max_model_len,
                        self.max_model_len)
            if (k := min(room, limit - seq.num_tokens - 1)) > 0:  # the step emits up to k + 1 tokens
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

    def _fail(self, req: Request, exc: Exception) -> None:
        """End this request alone with the error; its blocks go back, its samples finish as "error"."""
        log.error("request %s failed: %s: %s", req.request_id, type(exc).__name__, exc, exc_info=exc)
        req.error = f"{type(exc).__name__}: {exc}"
        for seq in req.seqs:
            if not seq.finished:
                req.deltas.setdefault(seq.index, CompletionOutput.empty(seq.index, req.wants_logprobs))
                self.scheduler.finish(seq, "error")

    def _collect_prompt_logprobs(self, req: Request, seq: Sequence, entries: PromptLogprobs) -> None:
        """Called before the chunk counts as computed; a preempted prompt starts over from its first token."""
        if seq.num_computed_tokens == 0:
            req.partial_prompt_logprobs = []
        req.partial_prompt_logprobs += entries
        if len(req.partial_prompt_logprobs) == seq.num_prompt_tokens:
            self._decode_logprob_tokens(req.partial_prompt_logprobs)
            req.prompt_logprobs, req.partial_prompt_logprobs = req.partial_prompt_logprobs, []

    def _decode_logprob_tokens(self, entries: list[dict[int, Logprob] | None]) -> None:
        for entry in entries:
            for tid, lp in (entry or {}).items():
                lp.decoded_token = self.tokenizer.decode([tid], skip_special_tokens=False)

    def _append_tokens(self, req: Request, item: ScheduledSeq, verdict: Verdict, now: float, step_time: float) -> None:
        """A step's tokens for one sequence, one at a time through the stop checks; the first one that ends
        the sequence is its last (the rest of an accepted run is dropped)."""
        seq, drafts = item.seq, item.spec_token_ids
        m = req.metrics
        if seq.num_output_tokens > 0:
            m.decode_step_times.append(step_time)
        m.first_token_time = m.first_token_time or now
        m.last_token_time = now
        finish = None
        for i, token in enumerate(verdict.token_ids):
            finish = self._append_token(req, seq, token, verdict.logprobs[i] if verdict.logprobs else None)
            if self.proposer is not None:  # which tokens were drafts, and what the model's own one replaced
                delta = req.deltas[seq.index]
                delta.draft_accepted.append(i < verdict.num_accepted)
                delta.drafts_rejected.append(drafts[i:] if drafts and i == verdict.num_accepted else None)
            if finish is not None:
                break
            if i < verdict.num_accepted:  # an accepted draft: this step computed its K/V
                seq.num_computed_tokens += 1
        self.blocks.register_computed(seq)  # before finishing, so the last blocks reach the prefix cache
        if finish is not None:
            self.scheduler.finish(seq, *finish)

    def _append_token(self, req: Request, seq: Sequence, token: int,
                      logprobs: dict[int, Logprob] | None) -> tuple[str, int | str | None] | None:
        """Emit one token; returns (finish reason, stop reason) when it ends the sequence."""
        p = seq.params
        seq.token_ids.append(token)
        if seq.grammar is not None and not seq.grammar.accept(token):
            raise RuntimeError(f"sampled token {token} breaks the grammar of request {req.request_id}")
        delta = req.deltas.setdefault(seq.index, CompletionOutput.empty(seq.index, req.wants_logprobs,
                                                                        self.proposer is not None))
        delta.token_ids.append(token)
        if logprobs is not None:
            self._decode_logprob_tokens([logprobs])
            seq.cumulative_logprob += logprobs[token].logprob
            delta.logprobs.append(logprobs)
        detokenizer = req.detokenizers[seq.index]
        stop_token = self._is_stop_token(seq, token)
        # A stop token (EOS or stop_token_ids) ends the text without showing it, as vLLM does.
        text, stop_str = ("", None) if stop_token and not p.include_stop_str_in_output else detokenizer.step(token)
        delta.text += text
        reason, stop_reason = self._finish_reason(seq, token, stop_token, stop_str)
        if reason is None:
            return None
        if stop_str is None:  # the held-back tail is shown only when no stop string ended it
            delta.text += detokenizer.flush()
        return reason, stop_reason

    def _is_stop_token(self, seq: Sequence, token: int) -> bool:
        p = seq.params
        if seq.num_output_tokens < p.min_tokens:
            return False
        return (not p.ignore_eos and token in self.eos_ids) or token in p.stop_token_ids

    def _finish_reason(self, seq: Sequence, token: int, stop_token: bool,
                       stop_str: str | None) -> tuple[str | None, int | str | None]:
        p = seq.params
        if stop_token:
            return "stop", token if token in p.stop_token_ids else None
        if stop_str is not None and seq.num_output_tokens >= p.min_tokens:
            return "stop", stop_str
        if seq.grammar is not None and seq.grammar.is_terminated:
            return "stop", None
        limit = seq.num_prompt_tokens + p.max_tokens if p.max_tokens else self.max_model_len
        if seq.num_tokens >= min(limit, self.max_model_len):
            return "length", None
        return None, None

    def _output(self, req: Request) -> RequestOutput:
        """The deltas since the last output of this request (the async engine streams these)."""
        deltas = []
        for index, delta in sorted(req.deltas.items()):
            seq = req.seqs[index]
            delta.finish_reason, delta.stop_reason = seq.finish_reason, seq.stop_reason
            delta.cumulative_logprob = seq.cumulative_logprob if seq.params.logprobs is not None else None
            deltas.append(delta)
        req.deltas = {}
        finished = req.finished
        if finished:
            if self.proposer is not None:
                for seq in req.seqs:
                    self.proposer.release(seq)
            req.metrics.finished_time = time.monotonic()
            req.metrics.num_cached_tokens = req.seqs[0].num_cached_tokens
            del self.requests[req.request_id]
        return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, deltas, finished, req.metrics,
                             req.prompt_logprobs, req.seqs[0].num_cached_tokens, req.error, req.inspection)
