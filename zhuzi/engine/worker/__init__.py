"""The engine's worker: builds the model, runs a scheduled step through it and the sampler, and drives the
other tensor-parallel ranks."""
