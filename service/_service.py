"""Plumbing every long-running Prism service shares: logging, SIGTERM, systemd notify, /metrics."""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading

from prometheus_client import CollectorRegistry, start_http_server


def setup_logging(level: str = "INFO") -> None:
    logging.basicConfig(
        level=level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )


def stop_on_signals(stop: threading.Event) -> None:
    """SIGTERM and SIGINT set `stop`, so the service's loop ends and closes its sockets."""

    def _handler(signum: int, _frame: object) -> None:
        logging.getLogger("prism").info("received %s, shutting down", signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGTERM, _handler)
    signal.signal(signal.SIGINT, _handler)


def sd_notify(state: str) -> bool:
    """Send `state` (e.g. "READY=1", "WATCHDOG=1") to systemd; False when not run under systemd."""
    address = os.environ.get("NOTIFY_SOCKET")
    if not address:
        return False
    if address.startswith("@"):
        address = "\0" + address[1:]
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        try:
            sock.sendto(state.encode(), address)
        except OSError:
            return False
    return True


def watchdog_interval_s() -> float | None:
    """Half the systemd watchdog period, or None when no watchdog is configured."""
    usec = os.environ.get("WATCHDOG_USEC")
    return int(usec) / 2e6 if usec and usec.isdigit() else None


class MetricsServer:
    """A running `/metrics` endpoint; `close()` stops it and frees the port."""

    def __init__(self, port: int, registry: CollectorRegistry, addr: str) -> None:
        self._server, self._thread = start_http_server(port, addr=addr, registry=registry)
        logging.getLogger("prism").info("serving /metrics on http://%s:%d/metrics", addr, port)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


def serve_metrics(port: int, registry: CollectorRegistry, addr: str = "127.0.0.1") -> MetricsServer | None:
    """Serve Prometheus `/metrics` for `registry` on `addr:port`; port 0 turns it off (returns None)."""
    return MetricsServer(port, registry, addr) if port else None
