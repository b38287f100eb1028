"""The engine's KV cache beyond the model runner's pool tensor: blocks and the prefix cache (block_manager),
the tiers blocks go to when the pool evicts them (connector, tiers), named prefixes kept resident (pins),
blocks shipped between prefill and decode replicas (transfer), and the one object the engine holds of them
(services)."""
