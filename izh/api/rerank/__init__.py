"""Rerank and score (vLLM's POST /v1/rerank, /rerank, /score, /v1/score) for an embedding model: the
bodies (protocol) and the routes (routes).
"""
