"""Ollama's API: /api/chat, /api/generate, /api/tags, /api/show, /api/ps and /api/version, run on the chat path
(common/chat.py) and answered in Ollama's words, NDJSON streams and {"error": ...} included."""
