"""KV-cache events for cache-aware routers, in vLLM's ZMQ/msgpack format (``--kv-events-config``).

``events``: vLLM's event structs and the conversion from the KV manager's records
(``jaxserve.core.cache_events``); ``publisher``: the ZMQ PUB/ROUTER publisher thread. Importing
this package imports neither msgspec nor pyzmq; the engine imports ``publisher`` only when
events are on (docs/kv-events.md).
"""
