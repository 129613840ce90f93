"""Long-document evaluation: QA with CP prefill and sharded-KV generation, needle in a haystack, loss by
position, base-vs-fine-tuned comparison. `longdoc eval --help` lists the commands."""
