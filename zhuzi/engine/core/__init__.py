"""The engine core: the step loop in its thread or process, the step (schedule, run, process the outputs), the
scheduler and its policies, the speculative proposers, and the KV pages (kv/)."""
