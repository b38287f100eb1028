"""`zhuzi bench decode --speculative-config ...`: one stream's decode speed with speculative decoding against
the same engine without it, in the same run: both loaded side by side, each prompt through one and then the
other (alternating which goes first). Greedy speculation emits exactly the plain tokens, so the ratio is a pure
speed ratio; with --temperature the two decode different texts.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
from dataclasses import asdict, dataclass

from zhuzi.bench import machine_line, model_label, save_report
from zhuzi.bench.datasets import input_grounded_chats, random_token_requests
from zhuzi.config import EngineConfig
from zhuzi.model import native


@dataclass
class SpecDecodeReport:
    machine: str
    speculative_config: dict
    workload: str
    num_prompts: int
    threads: int
    load_average: float  # 1-minute load average before the run: other work on the machine
    temperature: float
    plain_tokens: int  # decoded without speculation, the first token of each request not counted
    spec_tokens: int  # and with it
    plain_decode_s: float
    spec_decode_s: float
    identical_outputs: int  # prompts whose tokens came out the same with and without speculation
    num_drafts: int
    num_draft_tokens: int
    num_accepted_tokens: int

    @property
    def plain_tokens_per_s(self) -> float:
        return self.plain_tokens / self.plain_decode_s

    @property
    def spec_tokens_per_s(self) -> float:
        return self.spec_tokens / self.spec_decode_s

    @property
    def speedup(self) -> float:
        return self.spec_tokens_per_s / self.plain_tokens_per_s

    @property
    def mean_acceptance_length(self) -> float:
        """vLLM's: tokens a drafted step emits on average, the target's own included."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0

    def to_dict(self) -> dict:
        return asdict(self) | {name: getattr(self, name) for name in (
            "plain_tokens_per_s", "spec_tokens_per_s", "speedup", "mean_acceptance_length")}


def prompts(llm, args: argparse.Namespace) -> list[list[int]]:
    if args.workload == "grounded":
        return [llm.tokenizer.encode_chat(chat) for chat in input_grounded_chats(args.num_prompts, args.seed)]
    return [r.prompt_token_ids for r in random_token_requests(
        llm.tokenizer.hf, args.num_prompts, (args.prompt_len, args.prompt_len), (1, 1), args.seed,
        llm.model_config.vocab_size)]


def run(args: argparse.Namespace) -> SpecDecodeReport:
    import torch

    from zhuzi import LLM, SamplingParams

    config = EngineConfig.from_cli_args(args)
    load = os.getloadavg()[0]
    spec_llm = LLM(**vars(config))
    plain_llm = LLM(**vars(dataclasses.replace(config, speculative_config=None)))
    # A grounded answer ends where the model ends it; a random prompt's "answer" is only decode work.
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens,
                            ignore_eos=args.workload == "random")
    work = prompts(plain_llm, args)
    for llm in (plain_llm, spec_llm):  # warm-up: first-call costs
        llm.generate([work[0][:32]], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    before = spec_llm.engine.stats().spec_decoding
    seconds, tokens, identical = {"plain": 0.0, "spec": 0.0}, {"plain": 0, "spec": 0}, 0
    for i, prompt in enumerate(work):
        order = [("plain", plain_llm), ("spec", spec_llm)]
        outs = {}
        for name, llm in order if i % 2 == 0 else order[::-1]:
            out = llm.generate([prompt], params, use_tqdm=False)[0]
            seconds[name] += out.metrics.last_token_time - out.metrics.first_token_time
            outs[name] = out.outputs[0].token_ids
            tokens[name] += len(outs[name]) - 1
        identical += outs["plain"] == outs["spec"]
    after = spec_llm.engine.stats().spec_decoding
    report = SpecDecodeReport(
        machine=machine_line(native.current()), speculative_config=dataclasses.asdict(config.speculative),
        workload=args.workload,
        num_prompts=len(work), threads=torch.get_num_threads(), load_average=load, temperature=args.temperature,
        plain_tokens=tokens["plain"], spec_tokens=tokens["spec"],
        plain_decode_s=seconds["plain"], spec_decode_s=seconds["spec"], identical_outputs=identical,
        num_drafts=after.num_drafts - before.num_drafts,
        num_draft_tokens=after.num_draft_tokens - before.num_draft_tokens,
        num_accepted_tokens=after.num_accepted_tokens - before.num_accepted_tokens)
    print(format_report(report, args))
    return save_report(report, args.json_out)


def shown_config(config: dict) -> dict:
    """The speculative config as a report prints it: a draft model by its file name."""
    return config | {"model": model_label(config["model"])} if config.get("model") else config


def format_report(r: SpecDecodeReport, args: argparse.Namespace) -> str:
    rate = r.num_accepted_tokens / r.num_draft_tokens if r.num_draft_tokens else 0.0
    return "\n".join([
        "========= zhuzi bench decode, speculative =========",
        f"machine:      {r.machine}, {r.threads} threads, load average {r.load_average:.2f} before the run",
        f"speculation:  {json.dumps(shown_config(r.speculative_config))}",
        f"workload:     {r.num_prompts} {r.workload} prompts, one at a time, temperature {r.temperature:g}, up to "
        f"{args.max_tokens} tokens each; {r.identical_outputs}/{r.num_prompts} outputs identical with and without",
        f"without:      {r.plain_tokens_per_s:10.1f} tokens/s  ({r.plain_tokens} tokens in {r.plain_decode_s:.2f} s)",
        f"with:         {r.spec_tokens_per_s:10.1f} tokens/s  ({r.spec_tokens} tokens in {r.spec_decode_s:.2f} s)",
        f"speedup:      {r.speedup:10.2f}x",
        f"acceptance:   mean accepted length {r.mean_acceptance_length:.2f} (vLLM's: 1 + accepted / drafts), "
        f"{100 * rate:.1f} % of {r.num_draft_tokens} draft tokens in {r.num_drafts} drafts",
    ])
