"""`izh bench`: a streaming load generator for any OpenAI-compatible server.

Modules: ``datasets`` (prompts of known token lengths), ``runner`` (the async load generator), ``metrics``
(TTFT/TPOT/ITL/E2EL, percentiles, goodput, with `vllm bench serve`'s definitions), ``report`` (tables,
JSON result, plot, compare) and ``cli`` (the Typer command, and the server block of the result). The
HTTP client side it shares with ``izh chat`` and ``izh inspect`` (URLs, auth, errors, SSE decoding) is
``izh_cli.http``. Nothing here imports torch or the engine.
"""
