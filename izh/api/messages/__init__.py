"""Anthropic's Messages API (POST /v1/messages, /v1/messages/count_tokens) on chat's machinery: the
bodies (protocol), the body → chat request mapping (convert), the content blocks and stream events
(stream), the routes (routes).
"""
