"""The inspector: zhuzi's own endpoints under /inspect (the document a chat makes, the next-token distribution,
the logit lens, the BPE merges, the engine's and the batch's state) and the web page served at / (static/)
that shows them beside a chat."""
