"""A caller holding the printed join line, as its worst holder would use it (run on a machine of its own by
tests/integration/test_hostile_machine.py): it gets an agent certificate with the token, opens calls on the
coordinator's API port and on its bootstrap port that never send their requests, says how many are held and how many
were refused, and holds them for a while.

Usage: ``python hostile_caller.py HOST:PORT PIN TOKEN HOLD_S API_CALLS BOOTSTRAP_CALLS``
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Iterator

import grpc

from pliant.bootstrap import bootstrap_address, pinned_ca, request_certificate
from pliant.security.credentials import channel_credentials
from pliant.v1 import bootstrap_pb2, coordinator_pb2


def main(address: str, pin: str, token: str, hold_s: float, api_calls: int, bootstrap_calls: int) -> None:
    bootstrap = bootstrap_address(address)
    never = threading.Event()

    def requests() -> Iterator[bytes]:
        never.wait(hold_s)
        yield from ()

    def hold(channel: grpc.Channel, method: str, response: Callable[[bytes], object], n: int) -> tuple[int, int]:
        call = channel.stream_unary(method, request_serializer=bytes, response_deserializer=response)
        futures = [call.future(requests()) for _ in range(n)]
        time.sleep(5)
        done = [f for f in futures if f.done()]
        refused = sum(1 for f in done if f.code() == grpc.StatusCode.RESOURCE_EXHAUSTED)
        return n - len(done), refused

    material = request_certificate(bootstrap, pin, "default", "mallory", token)  # what the join line gives
    api = grpc.secure_channel(address, channel_credentials(material))
    held, refused = hold(
        api, "/pliant.v1.Coordinator/Heartbeat", coordinator_pb2.HeartbeatResponse.FromString, api_calls
    )
    print(f"api: {held} held, {refused} refused", flush=True)
    boot = grpc.secure_channel(bootstrap, grpc.ssl_channel_credentials(pinned_ca(bootstrap, pin)))
    method, response = "/pliant.v1.Bootstrap/IssueAgentCertificate", bootstrap_pb2.AgentCertificate.FromString
    held, refused = hold(boot, method, response, bootstrap_calls)
    print(f"bootstrap: {held} held, {refused} refused", flush=True)
    time.sleep(hold_s)
    never.set()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6]))
