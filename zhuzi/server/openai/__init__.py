"""OpenAI's API (and vLLM's extensions to it): /v1/chat/completions (and its /render), /v1/completions,
/v1/embeddings, /v1/models, /tokenize and /detokenize."""
