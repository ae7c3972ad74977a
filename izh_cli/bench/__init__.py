"""`izh bench`: a streaming load generator for any OpenAI-compatible server.

Modules: ``server`` (URLs, auth, SSE decoding, server info: shared with ``izh inspect`` and ``izh chat``),
``datasets`` (prompts of known token lengths), ``runner`` (the async load generator), ``metrics``
(TTFT/TPOT/ITL/E2EL, percentiles, goodput, with `vllm bench serve`'s definitions), ``report`` (tables,
JSON result, plot, compare) and ``cli`` (the Typer command). Nothing here imports torch or the engine.
"""
