"""The inspector's endpoints (/inspect/...), between the routes and the engine: the document a chat makes, the
next-token distribution and logit lens at some token ids, the BPE merges, snapshots of the engine and its batch.
Forward passes run as probes inside the engine's step loop, so every number is the answering model's own.
"""
from __future__ import annotations

import base64

from fastapi import Request
from fastapi.responses import Response

from zhuzi.bpe_replay import replay
from zhuzi.engine.sequence import Probe
from zhuzi.outputs import StepRow
from zhuzi.server.common import harmony
from zhuzi.server.common.errors import ApiError
from zhuzi.server.common.serving import Server, json_response
from zhuzi.server.inspect import protocol as ip
from zhuzi.server.pins.serving import cache_pin


class Inspector:
    def __init__(self, server: Server) -> None:
        self.server = server

    def _token(self, token_id: int) -> dict:
        raw = self.server.ready().tokenizer.bytes_of(token_id)
        return {"id": token_id, "token": raw.decode(errors="replace"), "bytes": list(raw)}

    async def next_token(self, request: Request, key: str, body: ip.NextTokenRequest) -> Response:
        self.server.check_model(body.model)
        outs = await self.server.probe(request, key, body.contexts, Probe(), "contexts")

        def answer() -> Response:  # a few MB of JSON for 16 contexts: built off the event loop
            results = []
            for ids, out in zip(body.contexts, outs):
                logits = out.inspection.logits
                top = logits.topk(min(body.top_n, logits.numel()))
                logprobs = logits.log_softmax(-1)[top.indices].tolist()
                full = base64.b64encode(logits.numpy().astype("<f4").tobytes()).decode() if body.full_logits else None
                results.append(ip.NextTokenResult(
                    position=len(ids) - 1, cached_tokens=out.num_cached_tokens, logits_b64=full,
                    top=[ip.NextTokenCandidate(**self._token(i), logit=z, logprob=lp)
                         for i, z, lp in zip(top.indices.tolist(), top.values.tolist(), logprobs)]))
            return json_response(ip.NextTokenResponse(vocab_size=outs[0].inspection.logits.numel(), results=results))

        return await self.server.in_worker(answer)

    async def logit_lens(self, request: Request, key: str, body: ip.LogitLensRequest) -> Response:
        self.server.check_model(body.model)
        (out,) = await self.server.probe(request, key, [body.token_ids], Probe(lens_top=body.top_k), "token_ids")
        layers = [ip.LensRow(layer=n, top=[ip.LensCandidate(**self._token(i), logprob=lp)
                                          for i, lp in zip(row.token_ids, row.logprobs)])
                  for n, row in enumerate(out.inspection.lens or [])]
        return json_response(ip.LogitLensResponse(
            position=len(body.token_ids) - 1, cached_tokens=out.num_cached_tokens,
            token=ip.InspectToken(**self._token(body.token_ids[-1])), layers=layers))

    async def document(self, key: str, body: ip.DocumentRequest) -> Response:
        self.server.check_model(body.model)
        tokenizer = self.server.ready().tokenizer

        def document() -> tuple[int, Response]:
            request = body.chat()
            chat = self.server.render_chat(request)  # the checks and errors of a chat request
            if self.server.harmony:  # zhuzi's own render, not the template's
                tokens = harmony.document(tokenizer, request, self.server.today())
                text = tokenizer.decode(chat.ids, skip_special_tokens=False)
            else:
                tokens = tokenizer.chat_document(chat.messages, **chat.args)
                text = tokenizer.render_chat(chat.messages, **chat.args)
            return len(chat.ids), json_response(ip.DocumentResponse(
                text=text, token_ids=chat.ids,
                tool_prompt=self.server.tool_prompt(request),
                tokens=[ip.DocumentToken(**self._token(t.id), author=t.author, special=t.special) for t in tokens]))

        count, response = await self.server.in_worker(document)
        self.server.gateway.charge_tokens(key, count)
        return response

    async def bpe(self, key: str, body: ip.BpeRequest) -> Response:
        self.server.check_model(body.model)
        tokenizer = self.server.ready().tokenizer

        def bpe() -> tuple[int, Response]:
            try:
                r = replay(tokenizer, body.text)
            except ValueError as exc:
                raise ApiError(400, str(exc), param="text") from exc
            return len(r.token_ids), json_response(ip.BpeResponse(
                words=[ip.BpeWord(text=w.text, pieces=[ip.InspectToken(**self._token(i)) for i in w.ids])
                       for w in r.words],
                steps=[ip.BpeStep(rank=s.rank, pair=s.pair, merged=ip.InspectToken(**self._token(s.merged_id)),
                                 at=s.at) for s in r.steps],
                token_ids=r.token_ids, tokenizer_token_ids=tokenizer.encode(body.text, add_special_tokens=False)))

        count, response = await self.server.in_worker(bpe)
        self.server.gateway.charge_tokens(key, count)
        return response

    async def engine(self, steps: int) -> Response:
        engine = self.server.ready()
        s = await engine.snapshot(steps)
        m, plan, stats = s.model, s.kv_plan, s.stats
        model = ip.EngineModel(
            name=self.server.model_name, architecture=m.architecture, dtype=s.dtype, cpu_kernels=s.cpu_kernels,
            bytes_per_value=plan.bytes_per_token // (2 * m.kv_layers * m.num_kv_heads * m.head_dim),
            num_layers=m.num_layers, num_heads=m.num_heads, num_kv_heads=m.num_kv_heads, head_dim=m.head_dim,
            hidden_size=m.hidden_size, vocab_size=m.vocab_size, max_model_len=s.max_model_len,
            kv_bytes_per_token=plan.bytes_per_token, weight_bytes_per_decode_step=s.weight_bytes_per_decode_step,
            eos_token_ids=m.eos_token_ids, special_token_ids=sorted(engine.tokenizer.all_special_ids))
        kv = ip.EngineKV(block_size=plan.page_size, num_blocks=stats.num_pages,
                        used_blocks=stats.num_pages - stats.num_free_pages, free_blocks=stats.num_free_pages,
                        cached_blocks=s.cached_pages, capacity_tokens=plan.capacity_tokens,
                        pool_bytes=plan.capacity_tokens * plan.bytes_per_token)
        queries, hits = stats.prefix_cache_queries, stats.prefix_cache_hits
        spec = engine.config.speculative
        return json_response(ip.EngineResponse(
            model=model, kv=kv, requests=ip.EngineRequests(
                running=stats.num_running, waiting=stats.num_waiting,
                tenants=[ip.EngineTenant(key=t.tenant or None, running=t.running, waiting=t.waiting)
                         for t in stats.tenants]),
            prefix_cache=ip.EnginePrefixCache(queries=queries, hits=hits, hit_rate=hits / queries if queries else None),
            kv_tiers=[ip.EngineKVTier(tier=name, blocks=t.pages, bytes=t.bytes, hit_tokens=t.hit_tokens,
                                      stored=t.stored, evicted=t.evicted, refused=t.refused)
                      for name, t in stats.kv_tiers.items()],
            pins=ip.EnginePins(blocks=stats.pinned_pages, bytes=stats.pinned_bytes, limit_bytes=s.pinned_limit_bytes,
                               pins=[cache_pin(info) for info in s.pins]),
            kv_transfers=ip.EngineTransfers(
                sent=stats.kv_transfers_sent, received=stats.kv_transfers_received, failed=stats.kv_transfers_failed,
                blocks_sent=stats.kv_transfer_pages_sent, blocks_received=stats.kv_transfer_pages_received),
            steps=[ip.EngineStep(index=r.index, age_s=s.time - r.end_time, duration_s=r.duration,
                                 prefill_tokens=r.prefill_tokens, decode_tokens=r.decode_tokens,
                                 verify_tokens=r.verify_tokens, kv_tokens_read=r.kv_tokens_read) for r in s.steps],
            roofline=ip.EngineRoofline(read_bandwidth_bytes_per_s=s.read_bandwidth,
                                      decode_step_floor_s=s.weight_bytes_per_decode_step / s.read_bandwidth),
            settings=ip.EngineSettings(deterministic=engine.config.deterministic,
                                       speculative_method=spec.method if spec else None,
                                       num_speculative_tokens=spec.num_speculative_tokens if spec else 0)))

    async def batch(self, steps: int, request_id: str | None) -> Response:
        """The recent steps row by row. Other requests stay anonymous: a row is marked as the caller's only
        when its engine request (the API id and the prompt's index) belongs to the request_id named."""
        s = await self.server.ready().snapshot(steps)
        numbers: dict[str, int] = {}

        def row(r: StepRow) -> ip.BatchRow:
            return ip.BatchRow(request=numbers.setdefault(r.request_id, len(numbers)), kind=r.kind, tokens=r.tokens,
                               yours=request_id is not None and r.request_id.rsplit("-", 1)[0] == request_id,
                               context=r.context, drafts=r.drafts, accepted=r.accepted)

        def answer() -> Response:
            return json_response(ip.BatchResponse(steps=[ip.BatchStep(
                index=r.index, age_s=s.time - r.end_time, duration_s=r.duration, prefill_tokens=r.prefill_tokens,
                decode_rows=r.decode_tokens, verify_tokens=r.verify_tokens, rows=[row(x) for x in r.rows])
                for r in s.steps]))

        return await self.server.in_worker(answer)
