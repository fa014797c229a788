"""Who may change models: the admin bearer token, and the refusal to serve
beyond loopback without one."""

from __future__ import annotations

import hmac
import ipaddress

from fastapi import Request

from compiler.errors import UnauthorizedError

from .settings import Settings


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_exposure(settings: Settings) -> None:
    if not is_loopback(settings.host) and not settings.admin_token:
        raise ValueError(
            f"refusing to serve on non-loopback host {settings.host!r} without JITSERVE_ADMIN_TOKEN: "
            "anyone could upload or delete models"
        )


def require_admin(request: Request) -> None:
    check_admin(request.app.state.settings.admin_token, request.headers.get("authorization", ""))


def check_admin(token: str | None, authorization: str) -> None:
    """401 unless ``authorization`` (an HTTP header or gRPC metadata value) is ``Bearer <token>``, when a
    token is set."""
    if not token:
        return
    scheme, _, given = authorization.partition(" ")
    # The scheme is case-insensitive (RFC 9110, 11.1); the token is compared in constant time.
    if scheme.lower() != "bearer" or not hmac.compare_digest(given.encode(), token.encode()):
        raise UnauthorizedError("this call needs 'Authorization: Bearer <admin token>'")
