"""The engine's KV cache beyond the model runner's pool tensor: pages and the prefix cache (page_manager),
the tiers pages go to when the pool evicts them (connector, tiers), named prefixes kept resident (pins),
pages shipped between prefill and decode replicas (transfer), and the one object the engine holds of them
(services)."""
