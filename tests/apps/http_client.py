"""Sends N GET requests, a new connection for most, a few kept alive; reports each connection's 4-tuple.

Run: python http_client.py HOST PORT N   -> prints one JSON summary line
"""

from __future__ import annotations

import http.client
import json
import sys


def main() -> None:
    host, port, count = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    tuples: list[list[object]] = []
    failures = 0
    sent = 0
    while sent < count:
        conn = http.client.HTTPConnection(host, port, timeout=10)
        try:
            conn.connect()
            local = conn.sock.getsockname()[:2]
            remote = conn.sock.getpeername()[:2]
            per_connection = 3 if sent % 50 == 0 else 1  # some connections carry several requests
            for _ in range(min(per_connection, count - sent)):
                conn.request("GET", f"/r{sent}", headers={"X-Test-Local-Port": str(local[1]), "X-Test-Local-Address": local[0]})
                conn.getresponse().read()
                tuples.append([local[0], local[1], remote[0], remote[1]])
                sent += 1
        except OSError:
            failures += 1
            sent += 1
        finally:
            conn.close()
    print(json.dumps({"requests": len(tuples), "failures": failures, "tuples": tuples}), flush=True)


if __name__ == "__main__":
    main()
