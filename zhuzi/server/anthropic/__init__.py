"""Anthropic's Messages API: /v1/messages and /v1/messages/count_tokens, run on the chat path (common/chat.py) and
answered in Anthropic's words, its error object and status codes included."""
