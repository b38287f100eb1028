"""The thinking budget, a step of output processing: a reasoning model's thought (between its own <think>
and </think> tokens, or Gemma 4's <|channel> and <channel|>) holds at most SamplingParams.thinking_token_budget
tokens; then the engine writes the close tag in place of the next sampled token, and the answer follows."""
from __future__ import annotations

from dataclasses import dataclass

from zhuzi.outputs import Logprob
from zhuzi.sampling_params import SamplingParams


@dataclass
class ThoughtBudget:
    """One sequence's thought: whether it is open, and how many of its tokens were written. A model whose
    vocabulary has no such tags never thinks, so the budget holds for it as it is. A thought the prompt opened
    (DeepSeek-R1 style templates end with <think>) counts from the reply's first token. The token written in
    place of the sampled one has logprob 0: the engine, not the distribution, chose it."""

    budget: int
    open_id: int
    close_id: int
    inside: bool
    spent: int = 0

    @classmethod
    def of(cls, params: SamplingParams, prompt: list[int], tags: tuple[int, int] | None) -> ThoughtBudget | None:
        """The budget of a request that set one (None without a budget, or for a model that cannot think)."""
        if params.thinking_token_budget is None or tags is None or params.structured_outputs is not None:
            return None
        open_id, close_id = tags
        last_open = max((i for i, t in enumerate(prompt) if t == open_id), default=-1)
        last_close = max((i for i, t in enumerate(prompt) if t == close_id), default=-1)
        return cls(params.thinking_token_budget, open_id, close_id, inside=last_open > last_close)

    def write(self, sampled: int, logprobs: dict[int, Logprob] | None) -> tuple[int, dict[int, Logprob] | None]:
        """The token that goes out in place of the sampled one (and its logprobs), and the thought's news."""
        token = self.close_id if self.inside and self.spent >= self.budget else sampled
        if token == self.open_id:
            self.inside, self.spent = True, 0
        elif token == self.close_id:
            self.inside = False
        elif self.inside:
            self.spent += 1
        if token != sampled and logprobs is not None:
            logprobs = {token: Logprob(0.0, 1)}
        return token, logprobs
