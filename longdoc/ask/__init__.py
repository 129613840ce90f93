"""The `longdoc ask` command: questions about your own documents, answered from one context-parallel prefill.

`cli` is the command and the checks made before any rank starts, `answer` what every rank runs (load, prefill,
answer), `console` the interactive prompt and the ranks' side of it.
"""
