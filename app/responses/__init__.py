"""OpenAI's Responses API on the chat pipeline: the request and its translation
(request.py), a chain's prompt (chain.py), the Response and its events (format.py,
stream.py), the stored responses (store.py) and the service over them (serving.py)."""
