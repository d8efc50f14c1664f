"""LAN discovery with mDNS (zeroconf): announce this agent and join the agents we hear of.

Where multicast is blocked, `--join host:port` does the same job explicitly.
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Callable

from zeroconf import IPVersion, ServiceBrowser, ServiceInfo, ServiceStateChange, Zeroconf

SERVICE = "_thunderpool._tcp.local."
log = logging.getLogger("thunderpool.discovery")


class Discovery:
    def __init__(
        self, node_id: str, version: str, address: str, port: int, on_found: Callable[[str], None]
    ):
        self.node_id, self.on_found = node_id, on_found
        interfaces = [address] if address not in ("0.0.0.0", "") else None
        self.zc = (
            Zeroconf(interfaces=interfaces, ip_version=IPVersion.V4Only)
            if interfaces
            else Zeroconf(ip_version=IPVersion.V4Only)
        )
        self.info = ServiceInfo(
            SERVICE,
            f"{node_id}.{SERVICE}",
            port=port,
            addresses=[socket.inet_aton(address)] if interfaces else None,
            properties={"node_id": node_id, "version": version},
        )
        self.browser: ServiceBrowser | None = None

    def start(self) -> Discovery:
        self.zc.register_service(self.info)
        self.browser = ServiceBrowser(self.zc, SERVICE, handlers=[self._changed])
        return self

    def _changed(
        self, zeroconf: Zeroconf, service_type: str, name: str, state_change: ServiceStateChange
    ) -> None:
        if state_change is not ServiceStateChange.Added or name.startswith(self.node_id):
            return
        threading.Thread(target=self._resolve, args=(service_type, name), daemon=True).start()

    def _resolve(self, service_type: str, name: str) -> None:
        info = self.zc.get_service_info(service_type, name, timeout=3000)
        if info is None or not info.parsed_addresses():
            return
        contact = f"{info.parsed_addresses()[0]}:{info.port}"
        try:
            self.on_found(contact)
        except Exception as e:  # a refused or unreachable peer must not stop discovery
            log.warning("mDNS peer %s: %s", contact, e)

    def close(self) -> None:
        try:
            self.zc.unregister_service(self.info)
        finally:
            self.zc.close()
