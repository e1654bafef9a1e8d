"""Where the control surface may be served and from where it is reached.

- The bind: loopback, or any other address with TLS (its bearer tokens and the `kv:forget`
  credentials it carries never cross a network in clear).
- Every request's `Host` is on an allow-list (loopback names, the bound address, and the names
  the operator lists) and its `Origin`, when a browser sends one, too (none by default): a page
  from another site whose name was made to resolve to this host (DNS rebinding) reaches nothing.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass

LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})
_WILDCARDS = frozenset({"0.0.0.0", "::", ""})
_HOST_NAME = re.compile(
    r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?(\.[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?)*$"
)
_ORIGIN = re.compile(r"^(https?)://([^/?#@]+)$")


def is_loopback(host: str) -> bool:
    """True for `localhost` and loopback IP literals; any other name may resolve anywhere."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_bind(host: str, tls: bool) -> None:
    """Refuse to serve a non-loopback address without TLS."""
    if not tls and not is_loopback(host):
        raise ValueError(
            f"kvci control_host {host!r} is not a loopback address: serving it needs TLS "
            "(control_tls_cert_file and control_tls_key_file), so that bearer tokens and "
            "credentials never cross the network in clear")


def host_name(value: str) -> str:
    """A Host allow-list entry as compared: lower case, no port, no brackets, no final dot.
    ValueError for anything that is not a DNS name or an IP literal."""
    name = value.strip().lower().rstrip(".")
    if name.startswith("[") and name.endswith("]"):
        name = name[1:-1]
    try:
        return str(ipaddress.ip_address(name))
    except ValueError:
        pass
    if not _HOST_NAME.match(name) or len(name) > 253:
        raise ValueError(f"{value!r} is not a host name (a DNS name or an IP address, no port)")
    return name


def origin(value: str) -> str:
    """An Origin allow-list entry as compared: `scheme://host[:port]`, lower case."""
    text = value.strip().lower().rstrip("/")
    match = _ORIGIN.match(text)
    if match is None:
        raise ValueError(f"{value!r} is not an origin (scheme://host[:port], e.g. "
                         "https://console.example)")
    return text


def _request_host(header: bytes) -> str | None:
    """The name in a Host header (port stripped), or None when it is not one."""
    try:
        text = header.decode("ascii")
    except UnicodeDecodeError:
        return None
    port = ""
    if text.startswith("["):  # [v6]:port
        end = text.find("]")
        if end < 0:
            return None
        text, rest = text[:end + 1], text[end + 1:]
        if rest and not rest.startswith(":"):
            return None
        port = rest[1:] if rest else ""
    elif ":" in text:  # name:port (a bare IPv6 literal is not a Host header)
        text, _, port = text.partition(":")
        if port == "":
            return None
    if port and not port.isdigit():
        return None
    try:
        return host_name(text)
    except ValueError:
        return None


@dataclass(frozen=True)
class HostPolicy:
    """The Host names and browser Origins the control surface answers."""

    hosts: frozenset[str]
    origins: frozenset[str] = frozenset()

    @classmethod
    def for_bind(cls, bind_host: str, allowed_hosts: tuple[str, ...] = (),
                 allowed_origins: tuple[str, ...] = ()) -> HostPolicy:
        """Loopback names, the bound address (unless a wildcard), and the names listed."""
        hosts = set(LOOPBACK_NAMES)
        if bind_host.strip("[]") not in _WILDCARDS:
            hosts.add(host_name(bind_host))
        hosts.update(host_name(h) for h in allowed_hosts)
        return cls(frozenset(hosts), frozenset(origin(o) for o in allowed_origins))

    def allows_host(self, header: bytes | None) -> bool:
        if header is None:
            return False
        name = _request_host(header)
        return name is not None and name in self.hosts

    def allows_origin(self, header: bytes | None) -> bool:
        """No Origin header (a client that is not a browser page) passes; any other must be
        listed."""
        if header is None:
            return True
        try:
            return origin(header.decode("ascii")) in self.origins
        except (UnicodeDecodeError, ValueError):
            return False
