"""What a browser page may not make a local server do.

A page on another site can send a simple POST to `localhost:8000`, and with DNS rebinding
(its own name resolving to 127.0.0.1) read the answers too. So `serve` refuses a request
whose `Host` names neither this server nor a name the user allowed (`--allowed-host`), and a
state-changing request whose `Origin` is another site's (not this server's own address, not a
`--cors-origin`). Clients that are not browsers send no `Origin` and are not affected. An IP
address as `Host` cannot be rebound, so every IP literal is taken.
"""

from __future__ import annotations

import ipaddress
import json
import socket
from collections.abc import Iterable
from urllib.parse import urlsplit

CHANGES_STATE = frozenset({"POST", "PUT", "PATCH", "DELETE"})


def _name(netloc: str) -> str:
    """The host of a `Host` header or an origin's netloc: no port, no brackets, lower case."""
    try:
        return (urlsplit(f"//{netloc}").hostname or "").rstrip(".")
    except ValueError:
        return ""


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


class HostGuard:
    """ASGI middleware: 400 for a foreign `Host`, 403 for a foreign `Origin` on a POST."""

    def __init__(
        self, app, bind: str, allowed: Iterable[str] = (), cors_origins: Iterable[str] = ()
    ):
        self.app = app
        me = socket.gethostname().lower()
        names = {"localhost", bind.lower(), me, f"{me}.local"}
        self.names = names | {a.lower().rstrip(".") for a in allowed}
        self.origins = {o.rstrip("/") for o in cors_origins}

    def host_ok(self, name: str) -> bool:
        if _is_ip(name) or name in self.names or name.endswith(".localhost"):
            return True
        return any(n.startswith("*.") and name.endswith(n[1:]) for n in self.names)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        host = headers.get("host", "")
        if not self.host_ok(_name(host)):
            why = (
                f"Host {host!r} is not a name of this server; a page that rebinds its own "
                "name to this address is refused. Behind a proxy, start serve with "
                f"--allowed-host {_name(host) or 'NAME'}"
            )
            return await _refuse(send, 400, why, "invalid_host")
        origin = headers.get("origin")
        if scope["method"] in CHANGES_STATE and origin is not None:
            same = urlsplit(origin).netloc.lower() == host.lower()  # this server's own page
            if not (same or "*" in self.origins or origin.rstrip("/") in self.origins):
                why = (
                    f"a {scope['method']} from a page at {origin!r} is refused (another site "
                    f"may not drive this server); to let a browser app there call it, start "
                    f"serve with --cors-origin {origin}"
                )
                return await _refuse(send, 403, why, "foreign_origin")
        return await self.app(scope, receive, send)


async def _refuse(send, status: int, message: str, code: str) -> None:
    body = json.dumps(
        {
            "error": {
                "message": message,
                "type": "invalid_request_error",
                "param": None,
                "code": code,
            }
        }
    ).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})
