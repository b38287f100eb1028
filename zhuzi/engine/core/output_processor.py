"""Output processing, the step after sampling: each emitted token through the stop checks and the
detokenizer, into the deltas a request streams; what the step decided for each sequence (how many drafts
stand, who ended and why) goes back to the scheduler as a StepOutcome."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from zhuzi.detokenizer import IncrementalDetokenizer
from zhuzi.engine.sequence import ScheduledSeq, Sequence, StepOutcome
from zhuzi.engine.worker.model_runner import PromptLogprobs, StepResult
from zhuzi.outputs import CompletionOutput, Inspection, Logprob, PinInfo, PromptProgress, RequestMetrics, RequestOutput
from zhuzi.sample.sampler import Verdict
from zhuzi.sampling_params import InvalidRequest, SamplingParams, StructuredOutputError
from zhuzi.tokenizer import Tokenizer

log = logging.getLogger("zhuzi")
Finish = tuple[str, int | str | None]  # finish reason, stop reason


@dataclass
class RequestState:
    """One request in the engine: its sequences, and what it has produced since its last output."""

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
    error_param: str | None = None  # the request's field at fault, where its own input made it fail
    inspection: Inspection | None = None  # a probe's reading, once its last token ran
    progress: PromptProgress | None = None  # news of the prompt's prefill since the last output
    pin: PinInfo | None = None  # a pin's, once its probe ran
    speculative: bool = False  # its outputs mark which tokens were drafts (a proposer guesses them)

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.seqs)

    def delta(self, index: int) -> CompletionOutput:
        """Sample index's news since the last output."""
        return self.deltas.setdefault(index, CompletionOutput.empty(index, self.params.logprobs is not None,
                                                                    self.speculative))


class OutputProcessor:
    """A step's tokens for a sequence are taken one at a time (a step with drafts emits its accepted ones plus
    one of the target's own): each is appended, advances the sequence's grammar, joins the delta with its
    logprobs and text, and is checked against EOS and stop_token_ids (not before min_tokens), stop strings,
    the grammar's end (which wins over min_tokens and ignore_eos) and the length limit. The first token that
    ends the sequence is its last; the rest of an accepted run is dropped. A stop token ends the text without
    showing it, as vLLM does; the text held back (an incomplete character, a possible stop-string prefix) is
    shown when the sequence ends otherwise. A thinking budget (thinking.py) may put </think> in place of a
    sampled token; what was drawn after that token is dropped too, as it followed another. A request whose
    processing raises fails alone."""

    def __init__(self, tokenizer: Tokenizer, eos_ids: list[int], max_model_len: int):
        self.tokenizer, self.eos_ids, self.max_model_len = tokenizer, eos_ids, max_model_len

    def process(self, batch: list[ScheduledSeq], result: StepResult, requests: dict[str, RequestState],
                start: float, end: float) -> StepOutcome:
        """A step's outputs into its requests' deltas; called before the batch counts as computed."""
        outcome = StepOutcome()
        failed = {item.seq.request_id: exc for item, exc in result.failed}
        for item in batch:
            req = requests[item.seq.request_id]
            req.metrics.first_scheduled_time = req.metrics.first_scheduled_time or start
            if item.seq.index == 0 and not item.seq.prompt_done:  # siblings share the first sample's prompt
                seq = item.seq  # the step's tokens do not count as computed yet
                done = min(seq.num_computed_tokens + item.num_new_tokens, seq.num_prompt_tokens)
                req.progress = PromptProgress(done, seq.num_prompt_tokens, seq.num_cached_tokens)
            entries = result.prompt_logprobs.get(item.seq.seq_id)
            if entries is not None and req.request_id not in failed:
                try:
                    self._collect_prompt_logprobs(req, item.seq, entries)
                except Exception as exc:
                    failed[req.request_id] = exc
        for item, verdict in result.sampled:
            req = requests[item.seq.request_id]
            if req.request_id not in failed:
                try:
                    self._emit(req, item, verdict, outcome, end, end - start)
                except Exception as exc:
                    failed[req.request_id] = exc
        for item, inspection in result.inspections:
            if item.seq.request_id not in failed:
                requests[item.seq.request_id].inspection = inspection
                outcome.emitted[item.seq.seq_id] = 0  # its reading stands: its pages join the prefix cache
                outcome.finished.append((item.seq, "stop", None))
        for request_id, exc in failed.items():
            self.fail(requests[request_id], exc, outcome)
        return outcome

    def fail(self, req: RequestState, exc: Exception, outcome: StepOutcome) -> None:
        """End this request alone with the error: its sequences not already ending finish as "error"."""
        if isinstance(exc, InvalidRequest):  # the request's own input, found as it ran: no fault of the engine's
            log.warning("request %s refused: %s", req.request_id, exc)
        else:
            log.error("request %s failed: %s: %s", req.request_id, type(exc).__name__, exc, exc_info=exc)
        req.error = f"{type(exc).__name__}: {exc}"
        req.error_param = exc.param if isinstance(exc, InvalidRequest) else None
        ending = {id(seq) for seq, _, _ in outcome.finished}
        for seq in req.seqs:
            if not seq.finished and id(seq) not in ending:
                req.delta(seq.index)
                outcome.finished.append((seq, "error", None))

    def abort(self, req: RequestState) -> list[Sequence]:
        """The sequences still running, each delta given the text held back so far."""
        running = [seq for seq in req.seqs if not seq.finished]
        for seq in running:
            req.delta(seq.index).text += req.detokenizers[seq.index].flush()
        return running

    def output(self, req: RequestState) -> RequestOutput:
        """The deltas since the last output of this request (what a client streams)."""
        deltas = []
        for index, delta in sorted(req.deltas.items()):
            seq = req.seqs[index]
            delta.finish_reason, delta.stop_reason = seq.finish_reason, seq.stop_reason
            delta.cumulative_logprob = seq.cumulative_logprob if seq.params.logprobs is not None else None
            deltas.append(delta)
        req.deltas, progress, req.progress = {}, req.progress, None
        if req.finished:
            req.metrics.finished_time = time.monotonic()
            req.metrics.num_cached_tokens = req.seqs[0].num_cached_tokens
        return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, deltas, req.finished, req.metrics,
                             req.prompt_logprobs, req.seqs[0].num_cached_tokens, req.error, req.inspection, progress,
                             req.pin, req.error_param)

    def _collect_prompt_logprobs(self, req: RequestState, seq: Sequence, entries: PromptLogprobs) -> None:
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

    def _emit(self, req: RequestState, item: ScheduledSeq, verdict: Verdict, outcome: StepOutcome, now: float,
              step_time: float) -> None:
        """A step's tokens for one sequence, one at a time through the stop checks; the first one that ends
        the sequence is its last (the rest of an accepted run is dropped)."""
        seq, m = item.seq, req.metrics
        if seq.num_output_tokens > 0:
            m.decode_step_times.append(step_time)
        m.first_token_time = m.first_token_time or now
        m.last_token_time = now
        standing = verdict.num_accepted
        for i, sampled in enumerate(verdict.token_ids):
            logprobs = verdict.logprobs[i] if verdict.logprobs else None
            token, logprobs = seq.thought.write(sampled, logprobs) if seq.thought else (sampled, logprobs)
            finish = self._append_token(req, seq, token, logprobs)
            if req.speculative:
                self._mark_draft(req.delta(seq.index), item.spec_token_ids, i, verdict.num_accepted)
            if finish is not None or token != sampled:  # what follows a replaced token was drawn after another
                standing = min(i, verdict.num_accepted)  # the drafts emitted before this one
                if finish is not None:
                    outcome.finished.append((seq, *finish))
                break
        outcome.emitted[seq.seq_id] = standing

    @staticmethod
    def _mark_draft(delta: CompletionOutput, drafts: list[int], i: int, num_accepted: int) -> None:
        """Whether the step's i-th token was an accepted draft; for the model's own token of a step that
        checked drafts, the drafts it replaced."""
        delta.draft_accepted.append(i < num_accepted)
        delta.drafts_rejected.append(drafts[i:] if drafts and i == num_accepted else None)

    def _append_token(self, req: RequestState, seq: Sequence, token: int,
                      logprobs: dict[int, Logprob] | None) -> Finish | None:
        """Emit one token; returns (finish reason, stop reason) when it ends the sequence."""
        p = seq.params
        seq.token_ids.append(token)
        if seq.grammar is not None and not seq.grammar.accept(token):
            # The grammar's mask allowed the token and its matcher refuses it: what the constraint requires
            # next has no token in this vocabulary (llguidance's mask lets a byte through that no token begins).
            raise StructuredOutputError(p.structured_outputs.kind if p.structured_outputs else "grammar",
                                        f"this model's vocabulary cannot write what the constraint requires after "
                                        f"{len(seq.token_ids) - seq.num_prompt_tokens - 1} tokens")
        delta = req.delta(seq.index)
        delta.token_ids.append(token)
        if logprobs is not None:
            self._decode_logprob_tokens([logprobs])
            seq.cumulative_logprob += logprobs[token].logprob
            delta.logprobs.append(logprobs)
        detokenizer = req.detokenizers[seq.index]
        stop_token = self._is_stop_token(seq, token)
        text, stop_str = ("", None) if stop_token and not p.include_stop_str_in_output else detokenizer.step(token)
        delta.text += text
        finish = self._finish(seq, token, stop_token, stop_str)
        if finish is not None and stop_str is None:  # the held-back tail is shown only when no stop string ended it
            delta.text += detokenizer.flush()
        return finish

    def _is_stop_token(self, seq: Sequence, token: int) -> bool:
        p = seq.params
        if seq.num_output_tokens < p.min_tokens:
            return False
        return (not p.ignore_eos and token in self.eos_ids) or token in p.stop_token_ids

    def _finish(self, seq: Sequence, token: int, stop_token: bool, stop_str: str | None) -> Finish | None:
        p = seq.params
        if stop_token:
            return "stop", token if token in p.stop_token_ids else None
        if stop_str is not None and seq.num_output_tokens >= p.min_tokens:
            return "stop", stop_str
        if seq.grammar is not None and seq.grammar.is_terminated:
            return "stop", None
        if seq.num_tokens >= seq.max_length(self.max_model_len):
            return "length", None
        return None
