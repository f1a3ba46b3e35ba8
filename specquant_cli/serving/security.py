"""What keeps a local server from being driven by the web pages its user visits.

A page on another site can send a browser's request to http://127.0.0.1:8080 — a "simple" cross-site POST
(text/plain body, no preflight) reaches the server, and with DNS rebinding (a name of the attacker's that
resolves to 127.0.0.1) the page can even read the answer. So, before anything else:

- `Host` must name this server: an IP address (a rebinding needs a name), `localhost` or a name under
  `.localhost` (browsers resolve those to loopback themselves), the address it is bound to, or a name given
  with --allow-host (`*`: any).
- `Origin`, when a browser sends one, must be the server's own (the chat page) or one given with
  --cors-origin (`*`: any); only those get CORS headers and an answer to a preflight.
- A POST body must be declared `application/json`.

Each refusal is a 4xx in OpenAI's error shape (serving.guard.Guard)."""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Optional

from specquant_cli.inputs import normal_origin  # noqa: F401  (named here too: the origin policy's normal form)

ANY = "*"
CORS_METHODS = "GET, POST, OPTIONS"
CORS_HEADERS = "Authorization, Content-Type, X-Specquant-Policy"


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host.strip("[]"))
        return True
    except ValueError:
        return False


def host_name(header: str) -> Optional[str]:
    """The name in a Host header (port and IPv6 brackets off, lower case), None when it is no host."""
    value = header.strip().lower()
    if not value or any(c in value for c in "/\\@?#% \t"):
        return None
    if value.startswith("["):
        end = value.find("]")
        if end < 0 or (value[end + 1:] and not value[end + 1:].startswith(":")):
            return None
        name = value[1:end]
        return name if _is_ip(name) else None
    name, _, port = value.partition(":")
    if port and not (port.isascii() and port.isdigit()):
        return None
    return name.rstrip(".") or None


@dataclass(frozen=True)
class OriginPolicy:
    """`bound`: the address the server listens on; `hosts`: extra names Host may carry (--allow-host);
    `origins`: origins allowed to call across sites (--cors-origin)."""

    bound: str = "127.0.0.1"
    hosts: frozenset[str] = frozenset()
    origins: frozenset[str] = frozenset()

    @classmethod
    def of(cls, bound: str, hosts: Iterable[str] = (), origins: Iterable[str] = ()) -> OriginPolicy:
        names = frozenset(h.strip().lower().rstrip(".") for h in hosts if h.strip())
        allowed = frozenset(o if o == ANY else (normal_origin(o) or o) for o in (x.strip() for x in origins) if o)
        return cls(bound.strip("[]").lower(), names, allowed)

    def host_problem(self, header: Optional[str]) -> Optional[str]:
        """Why a request with this Host header is not for this server, or None."""
        if ANY in self.hosts:
            return None
        if header is None:
            return "the request has no Host header"
        name = host_name(header)
        if name is None:
            return f"Host {header[:80]!r} is not a host name"
        if _is_ip(name) or name == "localhost" or name.endswith(".localhost") or name == self.bound or \
                name in self.hosts:
            return None
        return (f"Host {name[:80]!r} is not a name of this server; start it with --allow-host {name[:80]} to accept "
                "requests under that name")

    def origin_allowed(self, origin: str, host_header: Optional[str]) -> bool:
        """Whether a browser page of `origin` may call: the server's own page, or an allowed origin."""
        if ANY in self.origins:
            return True
        norm = normal_origin(origin)
        if norm is None:
            return False
        if norm in self.origins:
            return True
        if not host_header:
            return False
        own = {host_header.strip().lower()}
        own |= {h.rsplit(":", 1)[0] for h in own if h.endswith((":80", ":443"))}  # a default port may be left out
        return norm.split("://", 1)[1] in own

    def cross_site(self, origin: str, host_header: Optional[str]) -> bool:
        """Whether an allowed `origin` is another site's (it gets CORS headers), not the server's own page."""
        mine = OriginPolicy(self.bound, self.hosts, frozenset())
        return not mine.origin_allowed(origin, host_header)

    def cors_headers(self, origin: str, requested: Optional[str] = None) -> dict[str, str]:
        """The CORS answer headers for an allowed cross-site origin: the headers its preflight asks for (an
        OpenAI SDK sends X-Stainless-* ones) are allowed, and Retry-After can be read."""
        allowed = requested.strip() if requested and requested.strip() else CORS_HEADERS
        return {"access-control-allow-origin": origin, "vary": "Origin",
                "access-control-allow-methods": CORS_METHODS, "access-control-allow-headers": allowed,
                "access-control-expose-headers": "Retry-After", "access-control-max-age": "600"}


def is_json(content_type: Optional[str]) -> bool:
    """Whether a Content-Type header declares JSON (application/json, any parameters, any case)."""
    if content_type is None:
        return False
    return content_type.split(";", 1)[0].strip().lower() == "application/json"
