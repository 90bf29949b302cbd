"""Network namespaces joined by veth pairs, for tests that need real routed TCP (root only).

    with veth_pair() as (a, b):               # a.address == "10.N.M.1", b.address == "10.N.M.2"
        with b.entered():                     # this thread's new sockets live in namespace b
            listener = socket.create_server((b.address, 0))
        sock = a.call(socket.create_connection, (b.address, port))   # a socket made inside a
        client = a.popen([sys.executable, "-c", CODE])               # `ip netns exec a-name python -c CODE`
        b.run(["nft", "-f", "-"], stdin=RULES)                       # a command to completion, its stdout

    with host_veth() as node:                 # one namespace, reached from the test's own (root) namespace
        socket.create_connection((node.address, port))               # node.address == "198.18.K.2"

Names are unique per process and pair; on exit every process started by `popen` is killed and the
namespaces are deleted (with them their veth pairs), whatever happened inside. The pid and tid of code
run through `entered`/`call` are the test's own (only the calling thread switches namespaces; it switches
back afterwards).
"""

from __future__ import annotations

import ctypes
import itertools
import os
import socket
import subprocess
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from typing import Any, ParamSpec, TypeVar

from prismlb.service import wait_until

_CLONE_NEWNET = 0x40000000
_libc = ctypes.CDLL(None, use_errno=True)
_pairs = itertools.count()

_P = ParamSpec("_P")
_T = TypeVar("_T")


def _setns(fd: int) -> None:
    if _libc.setns(fd, _CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns: {os.strerror(err)}")


def _run(argv: Sequence[str], stdin: str | None = None) -> str:
    done = subprocess.run(argv, input=stdin, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} exited with {done.returncode}: {done.stderr.strip()}")
    return done.stdout


class Namespace:
    """A named network namespace (`ip netns`), with `address` on its veth end `veth0` (a /24)."""

    def __init__(self, name: str, address: str) -> None:
        self.name = name
        self.address = address
        self._children: list[subprocess.Popen[bytes]] = []

    @contextmanager
    def entered(self) -> Iterator[None]:
        """Move the calling thread into this namespace for the block, then back."""
        with open("/proc/thread-self/ns/net", "rb") as home, open(f"/run/netns/{self.name}", "rb") as target:
            _setns(target.fileno())
            try:
                yield
            finally:
                _setns(home.fileno())

    def call(self, fn: Callable[_P, _T], *args: _P.args, **kwargs: _P.kwargs) -> _T:
        """fn(*args, **kwargs) run in the calling thread inside this namespace."""
        with self.entered():
            return fn(*args, **kwargs)

    def popen(self, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen[bytes]:
        """`ip netns exec NAME argv…` started with subprocess.Popen(**kwargs); killed when the pair closes."""
        child: subprocess.Popen[bytes] = subprocess.Popen(["ip", "netns", "exec", self.name, *argv], **kwargs)
        self._children.append(child)
        return child

    def run(self, argv: Sequence[str], stdin: str | None = None) -> str:
        """Run `argv` inside the namespace to completion (`stdin` as its input) and return its stdout; raises
        RuntimeError with its stderr on a non-zero exit."""
        return _run(["ip", "netns", "exec", self.name, *argv], stdin)

    def _kill_children(self) -> None:
        for child in self._children:
            if child.poll() is None:
                child.kill()
            child.wait()


@contextmanager
def veth_pair() -> Iterator[tuple[Namespace, Namespace]]:
    """Namespaces a and b, loopback up in each, joined by veth0 <-> veth0 at 10.N.M.1/24 and 10.N.M.2/24."""
    n = next(_pairs)
    prefix = f"prism{os.getpid()}x{n}"
    subnet = f"10.{os.getpid() % 250 + 1}.{n % 256}"
    a = Namespace(f"{prefix}a", f"{subnet}.1")
    b = Namespace(f"{prefix}b", f"{subnet}.2")
    with ExitStack() as cleanup:
        for ns in (a, b):
            _run(["ip", "netns", "add", ns.name])
            cleanup.callback(subprocess.run, ["ip", "netns", "delete", ns.name], capture_output=True)
            cleanup.callback(ns._kill_children)
        _run(["ip", "link", "add", "veth0", "netns", a.name, "type", "veth", "peer", "name", "veth0", "netns", b.name])
        for ns in (a, b):
            _configure(ns)
        yield a, b


def _configure(ns: Namespace) -> None:
    ns.run(["ip", "addr", "add", f"{ns.address}/24", "dev", "veth0"])
    ns.run(["ip", "link", "set", "veth0", "up"])
    ns.run(["ip", "link", "set", "lo", "up"])


@contextmanager
def host_veth() -> Iterator[Namespace]:
    """A namespace whose veth0 (198.18.K.2/24) is joined to the calling process's own namespace (198.18.K.1/24),
    so that the test's own sockets reach it. 198.18.0.0/15 is set aside for benchmarking networks (RFC 2544),
    so the /24 route this adds to the host is one no real network uses."""
    n = next(_pairs)
    k = (os.getpid() * 16 + n) % 512
    subnet = f"198.{18 + k // 256}.{k % 256}"
    ns = Namespace(f"prism{os.getpid()}x{n}", f"{subnet}.2")
    host_end = f"pr{os.getpid()}x{n}"
    with ExitStack() as cleanup:
        _run(["ip", "netns", "add", ns.name])
        cleanup.callback(subprocess.run, ["ip", "netns", "delete", ns.name], capture_output=True)
        cleanup.callback(ns._kill_children)
        _run(["ip", "link", "add", host_end, "type", "veth", "peer", "name", "veth0", "netns", ns.name])
        cleanup.callback(subprocess.run, ["ip", "link", "delete", host_end], capture_output=True)
        _run(["ip", "addr", "add", f"{subnet}.1/24", "dev", host_end])
        _run(["ip", "link", "set", host_end, "up"])
        _configure(ns)
        yield ns


def wait_listening(address: str, port: int, limit_s: float, proc: subprocess.Popen[bytes] | None = None) -> None:
    """Return once something accepts TCP connections at `address:port`; RuntimeError after `limit_s`, or as soon as
    `proc`, the server meant to listen there, has exited."""

    def listening() -> bool:
        try:
            socket.create_connection((address, port), timeout=1).close()
            return True
        except OSError:
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(f"nothing listens at {address}:{port}: its server exited") from None
            return False

    if not wait_until(listening, limit_s):
        raise RuntimeError(f"nothing listens at {address}:{port}")
