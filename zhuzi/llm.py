"""Offline API with vLLM's names: LLM(...).generate(prompts, params), .chat(messages, params) and
.embed(prompts); zhuzi's pins (.pin, .unpin, .pins) keep a prefix's KV pages in the pool."""
from __future__ import annotations

import itertools

import torch
from tqdm import tqdm

from zhuzi.config import EngineConfig
from zhuzi.engine.core.engine_core import EngineCore
from zhuzi.engine.sequence import PinSpec, Probe
from zhuzi.outputs import CompletionOutput, PinInfo, RequestError, RequestOutput
from zhuzi.sampling_params import SamplingParams


def merge(total: RequestOutput | None, delta: RequestOutput) -> RequestOutput:
    """Fold one step's news into the cumulative output of a request."""
    if total is None:
        total = RequestOutput(delta.request_id, delta.prompt, delta.prompt_token_ids, [], False)
    by_index = {c.index: c for c in total.outputs}
    for d in delta.outputs:
        c = by_index.setdefault(d.index, CompletionOutput.empty(d.index, d.logprobs is not None,
                                                                d.draft_accepted is not None))
        c.text += d.text
        c.token_ids += d.token_ids
        if d.logprobs is not None:
            c.logprobs += d.logprobs
        if d.draft_accepted is not None:
            c.draft_accepted += d.draft_accepted
            c.drafts_rejected += d.drafts_rejected
        c.finish_reason, c.stop_reason, c.cumulative_logprob = d.finish_reason, d.stop_reason, d.cumulative_logprob
    total.outputs = sorted(by_index.values(), key=lambda c: c.index)
    total.finished, total.metrics = delta.finished, delta.metrics
    total.num_cached_tokens = delta.num_cached_tokens
    total.prompt_logprobs = delta.prompt_logprobs or total.prompt_logprobs
    total.error = delta.error
    return total


class LLM:
    def __init__(self, model: str | None = None, **options):
        self.engine = EngineCore(EngineConfig(model=model, **options))
        self.tokenizer = self.engine.tokenizer
        self.model_config = self.engine.model_config
        self._ids = itertools.count()

    @property
    def weight_bytes_per_decode_step(self) -> int:
        return self.engine.weight_bytes_per_decode_step

    def generate(self, prompts: str | list[int] | list[str] | list[list[int]],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """Run every prompt as one batch; results come back in the order of the prompts. A prompt the
        engine failed (see EngineCore.step) raises RequestError once the others have finished."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params or SamplingParams()
        params = params if isinstance(params, list) else [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} sampling_params for {len(prompts)} prompts")
        ids = [f"offline-{next(self._ids)}" for _ in prompts]
        for rid, prompt, p in zip(ids, prompts, params):
            self.engine.add_request(rid, prompt, p)
        results: dict[str, RequestOutput] = {}
        with tqdm(total=len(ids), desc="generate", unit="req", disable=not use_tqdm) as bar:
            while self.engine.has_unfinished():
                for delta in self.engine.step():
                    results[delta.request_id] = merge(results.get(delta.request_id), delta)
                    bar.update(delta.finished)
        outputs = [results[rid] for rid in ids]
        if failed := [f"prompt {i}: {out.error}" for i, out in enumerate(outputs) if out.error]:
            raise RequestError("generation failed for " + "; ".join(failed))
        return outputs

    def embed(self, prompts: str | list[int] | list[str] | list[list[int]]) -> list[torch.Tensor]:
        """Each prompt's embedding ([hidden_size] float32, L2-normalized): its final hidden states (after the last
        norm) pooled as EngineConfig.pooling says, the prompts batched through the step loop."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        outs = self._probe(prompts, Probe(embed=True))
        if failed := [f"prompt {i}: {out.error}" for i, out in enumerate(outs) if out.inspection is None]:
            raise RequestError("embedding failed for " + "; ".join(failed))
        return [out.inspection.embedding for out in outs]

    def pin(self, name: str, prompt: str | list[int], ttl: float | None = None) -> PinInfo:
        """Keep the KV pages of prompt's full pages in the pool (and the tiers) under name, until unpin(name)
        or for ttl seconds; a pin under the same name is replaced. InvalidRequest if it does not fit."""
        (out,) = self._probe([prompt], Probe(pin=PinSpec(name, ttl)))
        if out.pin is None:
            raise RequestError(f"pinning {name!r} failed: {out.error or 'no output'}")
        return out.pin

    def _probe(self, prompts: list[str] | list[list[int]], probe: Probe) -> list[RequestOutput]:
        """Each prompt as a probe through the step loop, together: their final outputs, in order."""
        ids = [f"probe-{next(self._ids)}" for _ in prompts]
        for rid, prompt in zip(ids, prompts):
            self.engine.add_probe(rid, prompt, probe)
        finals: dict[str, RequestOutput] = {}
        while self.engine.has_unfinished():
            finals.update((o.request_id, o) for o in self.engine.step() if o.finished)
        return [finals[rid] for rid in ids]

    def unpin(self, name: str) -> bool:
        return self.engine.kv.pins.remove(name)

    def pins(self) -> list[PinInfo]:
        return self.engine.kv.pins.list()

    def chat(self, messages: list[dict] | list[list[dict]], sampling_params: SamplingParams | None = None,
             **template_options) -> list[RequestOutput]:
        """Apply the checkpoint's chat template (user text stays plain text) and generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.tokenizer.encode_chat(c, **template_options) for c in conversations]
        return self.generate(prompts, sampling_params)
