"""Dynamo's own ForwardPassMetrics module for the fleet-metrics tests
(``tests/support/dynamo_wheel.py``: the released ai-dynamo wheel's file, run unmodified)."""

from __future__ import annotations

import socket
import types

import pytest
import zmq

from tests.support.dynamo_wheel import load_forward_pass_metrics


@pytest.fixture(scope="session")
def dynamo() -> types.ModuleType:
    """``dynamo.common.forward_pass_metrics`` from ai-dynamo 1.6.1's wheel."""
    return load_forward_pass_metrics()


@pytest.fixture
def ctx():
    c = zmq.Context()
    yield c
    c.destroy(linger=0)


def free_port() -> int:
    """A TCP port nothing listens on now (its neighbour may be taken)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def subscriber(ctx: zmq.Context, port: int) -> zmq.Socket:
    """A SUB socket on ``port``, as Dynamo's relay connects (``tcp://127.0.0.1:PORT``)."""
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.RCVHWM, 0)
    sub.setsockopt(zmq.RCVTIMEO, 5_000)
    sub.connect(f"tcp://127.0.0.1:{port}")
    return sub
