"""Anthropic's Messages API (POST /v1/messages, /v1/messages/count_tokens) on the chat
pipeline: the request and its translation (request.py), the Message and its stream
(message.py); the routes are app/routes/messages.py."""
