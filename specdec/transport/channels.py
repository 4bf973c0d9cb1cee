"""Client channels towards the services: TLS credentials and tuned options.

Not for: servers (``specdec.transport.server``).
"""

from __future__ import annotations

from pathlib import Path

import grpc

from specdec.config import TlsConfig


def channel_credentials(tls: TlsConfig) -> grpc.ChannelCredentials | None:
    """TLS for a client; cert/key are presented for mutual TLS."""
    if not tls.enabled:
        return None
    return grpc.ssl_channel_credentials(
        root_certificates=Path(tls.ca).read_bytes() if tls.ca else None,
        private_key=Path(tls.key).read_bytes() if tls.key else None,
        certificate_chain=Path(tls.cert).read_bytes() if tls.cert else None,
    )


def keepalive_options(seconds: float) -> list[tuple[str, int]]:
    """HTTP/2 keepalive for a client channel: while a call is open, ping the
    connection every ``seconds``, and give it up (its calls fail UNAVAILABLE) when
    a ping is not answered in as long. A peer whose node died or was cut off
    without a reset is then found within twice ``seconds``, not at each call's
    deadline. The services accept a ping a second at most (``MIN_KEEPALIVE_S``)."""
    ms = int(seconds * 1000)
    return [
        ("grpc.keepalive_time_ms", ms),
        ("grpc.keepalive_timeout_ms", ms),
        ("grpc.http2.ping_timeout_ms", ms),  # (grpc 1.6x on)
        ("grpc.http2.max_pings_without_data", 0),
    ]


def open_channel(
    address: str, tls: TlsConfig, max_message_bytes: int, keepalive_s: float | None = None
) -> grpc.aio.Channel:
    """A channel to a model service; ``keepalive_s``: see ``keepalive_options``."""
    options = [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.enable_retries", 0),
        # Reconnect quickly to a restarted service (gRPC's default backs off to 120 s).
        ("grpc.initial_reconnect_backoff_ms", 100),
        ("grpc.min_reconnect_backoff_ms", 100),
        ("grpc.max_reconnect_backoff_ms", 1000),
    ]
    if keepalive_s:
        options += keepalive_options(keepalive_s)
    creds = channel_credentials(tls)
    if creds is None:
        return grpc.aio.insecure_channel(address, options=options)
    return grpc.aio.secure_channel(address, creds, options=options)
