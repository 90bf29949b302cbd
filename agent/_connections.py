"""TCP connections as the kernel saw them, and an index to find the one a span travelled on."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Role = Literal["client", "server"]
FourTuple = tuple[str, int, str, int]


@dataclass(slots=True)
class Connection:
    """One TCP connection; times are epoch nanoseconds (kernel monotonic time already aligned)."""

    sock_id: int
    role: Role
    local_addr: str
    local_port: int
    remote_addr: str
    remote_port: int
    established_unix_ns: int
    pid: int | None = None
    tid: int | None = None
    comm: str | None = None
    process_start_unix_s: float | None = None
    handshake_us: float | None = None
    closed_unix_ns: int | None = None
    bytes_sent: int = 0
    bytes_received: int = 0
    retransmits: int = 0
    first_span_unix_ns: int | None = None

    @property
    def four_tuple(self) -> FourTuple:
        """(local address, local port, remote address, remote port)."""
        return (self.local_addr, self.local_port, self.remote_addr, self.remote_port)

    def alive_at(self, unix_ns: int, slack_ns: int) -> bool:
        end = self.closed_unix_ns
        return self.established_unix_ns - slack_ns <= unix_ns and (end is None or unix_ns <= end + slack_ns)
