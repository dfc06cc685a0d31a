"""Whether a tracking server answers, asked before a run depends on it (W&B, an MLflow server)."""

from __future__ import annotations

import socket
from urllib.parse import urlsplit

# Seconds to wait for a server to answer a connection (W&B then logs offline; MLflow is refused in one line).
PROBE_TIMEOUT_S = 5.0


def server_reachable(url: str, timeout: float = PROBE_TIMEOUT_S) -> bool:
    """True when a TCP connection to the server of ``url`` opens within ``timeout`` seconds."""
    parts = urlsplit(url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        with socket.create_connection((parts.hostname or "", port), timeout=timeout):
            return True
    except OSError:
        return False
