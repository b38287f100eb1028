"""What every API of the server shares, between its routes and the engine: the gateway (keys, rates, quotas,
the queue), the serving machinery (generate, stream, drain, health), the parsers and tool grammars of a
reply, its content blocks, the store that outlives the process, and the metrics. It speaks OpenAI's chat
request (openai/protocol.py): the chat path every other API's request becomes."""
