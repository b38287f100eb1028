"""OpenAI's API (and vLLM's extensions to it): /v1/chat/completions (and its /render), /v1/completions, /v1/models,
/tokenize and /detokenize. Its chat request is the chat path that Anthropic's Messages and the Responses API
become."""
