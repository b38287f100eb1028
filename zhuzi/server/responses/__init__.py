"""OpenAI's Responses API: /v1/responses, and the stored responses' GET, DELETE and input_items, run on the chat
path (openai/) and kept in the server's store (common/store.py)."""
