"""What every API of the server shares, importing none of them: the chat request every API's body becomes and
the chat path it runs, the gateway, the serving machinery, the parsers and tool grammars, the errors (in no
API's shape), the store and the metrics."""
