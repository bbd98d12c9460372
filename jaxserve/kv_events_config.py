"""``--kv-events-config``: vLLM's ``KVEventsConfig`` (``vllm/config/kv_events.py``), parsed and
checked; the events and their wire format are ``jaxserve.kv_events``' (docs/kv-events.md).
A module of its own so that ``jaxserve.config`` stays one screenful of engine settings.
"""

from __future__ import annotations

import dataclasses
import json
import typing
from dataclasses import dataclass

KV_EVENT_PUBLISHERS = ("null", "zmq")
EVENT_ENCODINGS = ("map", "array")  # jaxserve.kv_events.events.EVENT_ENCODINGS
ENDPOINT_SCHEMES = ("tcp://", "ipc://", "inproc://")


@dataclass(frozen=True)
class KVEventsConfig:
    """KV-cache event publishing: vLLM's ``KVEventsConfig`` (``vllm/config/kv_events.py``),
    the same fields, defaults and JSON (``--kv-events-config``), plus jaxserve's
    ``event_encoding`` (``jaxserve.kv_events.events``). Events are
    ``jaxserve.kv_events``'s; the endpoints of data-parallel replica ``i`` get ``i`` added to
    their tcp port (``inproc`` ones a ``_dp{i}`` suffix), as vLLM's.

    Raises:
      ValueError: naming the field, for a wrong type or value.
    """

    enable_kv_cache_events: bool = False  # record and publish events
    publisher: str | None = None  # "zmq" or "null"; None: "zmq" when enabled, else "null"
    endpoint: str = "tcp://*:5557"  # the PUB socket; bound if it has '*', '::', ipc or inproc
    replay_endpoint: str | None = None  # the ROUTER socket replaying buffered batches
    buffer_steps: int = 10_000  # batches kept for replay
    hwm: int = 100_000  # the PUB socket's high-water mark (batches per slow subscriber)
    max_queue_size: int = 100_000  # batches queued for the publisher thread; more are dropped
    topic: str = ""  # the first frame of every message
    # jaxserve's own field (vLLM sends one encoding per release): "map", the tagged-map events
    # of vLLM 0.32; "array", the tagged arrays of the releases before it
    event_encoding: str = "map"

    def __post_init__(self) -> None:
        hints = typing.get_type_hints(KVEventsConfig)
        for f in dataclasses.fields(self):
            value, kinds = getattr(self, f.name), typing.get_args(hints[f.name]) or (
                hints[f.name],)
            if value is None and type(None) in kinds:
                continue
            if not any(type(value) is k for k in kinds):  # bool is not an int here
                raise ValueError(f"kv_events_config field {f.name!r} must be "
                                 f"{' or '.join(k.__name__ for k in kinds)}, got {value!r}")
        if self.publisher is None:
            object.__setattr__(self, "publisher",
                               "zmq" if self.enable_kv_cache_events else "null")
        if self.publisher not in KV_EVENT_PUBLISHERS:
            raise ValueError(f"kv_events_config field 'publisher' must be one of "
                             f"{KV_EVENT_PUBLISHERS}, got {self.publisher!r}")
        if self.event_encoding not in EVENT_ENCODINGS:
            raise ValueError(f"kv_events_config field 'event_encoding' must be one of "
                             f"{EVENT_ENCODINGS}, got {self.event_encoding!r}")
        for name in ("endpoint", "replay_endpoint"):
            value = getattr(self, name)
            if value is not None and not value.startswith(ENDPOINT_SCHEMES):
                raise ValueError(f"kv_events_config field {name!r} must start with one of "
                                 f"{ENDPOINT_SCHEMES}, got {value!r}")
        for name, least in (("buffer_steps", 1), ("hwm", 0), ("max_queue_size", 1)):
            if getattr(self, name) < least:
                raise ValueError(f"kv_events_config field {name!r} must be >= {least}, got "
                                 f"{getattr(self, name)}")

    @classmethod
    def from_json(cls, text: str) -> KVEventsConfig:
        """Parse ``--kv-events-config``'s JSON object.

        Raises:
          ValueError: not JSON, not an object, an unknown field (named), or a bad value.
        """
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"kv_events_config is not valid JSON: {e}") from None
        if not isinstance(data, dict):
            raise ValueError("kv_events_config must be a JSON object of vLLM's KVEventsConfig "
                             "fields")
        names = [f.name for f in dataclasses.fields(cls)]
        for k in data:
            if k not in names:
                raise ValueError(f"kv_events_config has an unknown field {k!r} (fields: "
                                 f"{', '.join(names)})")
        return cls(**data)

    @property
    def publishing(self) -> bool:
        """Whether events are recorded and sent over ZMQ."""
        return self.enable_kv_cache_events and self.publisher == "zmq"
