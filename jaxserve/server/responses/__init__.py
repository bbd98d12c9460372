"""The OpenAI Responses API (``/v1/responses``) on the chat-completions path: ``protocol`` (its
bodies and stream events), ``handler`` (a request as a chat request; the store of finished
responses) and ``output`` (reply text -> output items and stream events)."""
