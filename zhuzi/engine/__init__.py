"""The engine, by role as vLLM v1 splits it: front/ (what the server holds) -> core/ (the step loop) -> worker/
(the model), and beside them the data they share (sequence.py, thinking.py) and the wire between the front
and the core (messages.py)."""
