"""OpenAI's Responses API: /v1/responses, and the stored responses' GET, DELETE and input_items, run on the chat
path (common/chat.py) and kept by store.py in the server's SQLite file (common/store.py)."""
