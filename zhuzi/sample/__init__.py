"""Sampling, the step after the forward pass: logits -> tokens.

sampler.py draws each sequence's next token (grammar masks, bias, penalties, temperature, top-k/p,
min-p, seeded draws, logprobs); rejection.py verifies speculative drafts on the very distribution the
sampler draws from; grammar.py compiles structured-output constraints into the token masks both apply.
"""
