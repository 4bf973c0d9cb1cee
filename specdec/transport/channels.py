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


def open_channel(address: str, tls: TlsConfig, max_message_bytes: int) -> grpc.aio.Channel:
    options = [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.enable_retries", 0),
        # Reconnect quickly to a restarted service (gRPC's default backs off to 120 s).
        ("grpc.initial_reconnect_backoff_ms", 100),
        ("grpc.min_reconnect_backoff_ms", 100),
        ("grpc.max_reconnect_backoff_ms", 1000),
    ]
    creds = channel_credentials(tls)
    if creds is None:
        return grpc.aio.insecure_channel(address, options=options)
    return grpc.aio.secure_channel(address, creds, options=options)
