"""The engine's worker: builds the model (the target and a draft model alike), runs a scheduled step through it
and the sampler, and drives the other tensor-parallel ranks."""
