"""Dependency URLs without their secrets.

``catalog_url`` and ``blob_url`` travel in ``kv_connector_extra_config``, which reaches vLLM's
command line, its logged configuration and any validation error: a password written into one
would be everywhere. So a URL carrying a password is refused, the password comes from a file
(``catalog_password_file``, ``blob_password_file``: owner-only, like every secret file kvci
reads) or, for PostgreSQL, from libpq's own ``PGPASSFILE``/``PGPASSWORD``, and it is put into the
URL in memory only, when the connection is made.
"""

from __future__ import annotations

from pathlib import Path
from urllib.parse import parse_qsl, quote, urlencode, urlsplit, urlunsplit

from kvci_plugin.tiering.secret import read_secret_file


def check_no_password(name: str, url: str | None) -> str | None:
    """``url`` unless it carries a password (the error names the key, never the URL)."""
    if url is None:
        return None
    parts = urlsplit(url)
    in_query = any(k == "password" for k, _ in parse_qsl(parts.query))
    if parts.password is not None or in_query:
        raise ValueError(
            f"{name} carries a password, which would reach vLLM's command line and logs: put it "
            f"in a file named by {name.replace('_url', '_password_file')} (owner-only)"
            + (", or in libpq's PGPASSFILE / PGPASSWORD" if name == "catalog_url" else ""))
    return url


def with_password(url: str, password_file: Path | None) -> str:
    """``url`` with the password of ``password_file`` (trailing newline dropped) put in it."""
    if password_file is None:
        return url
    password = read_secret_file(password_file).decode().rstrip("\r\n")
    parts = urlsplit(url)
    if parts.scheme == "unix":  # a socket path has no authority: redis-py reads the query
        query = urlencode([*parse_qsl(parts.query), ("password", password)])
        return f"unix://{parts.netloc}{parts.path}?{query}"
    host = parts.netloc.rpartition("@")[2]
    user = quote(parts.username or "", safe="")
    return urlunsplit(parts._replace(netloc=f"{user}:{quote(password, safe='')}@{host}"))


def redacted(url: str) -> str:
    """``url`` as kvci may print it: no user, no password, no query."""
    parts = urlsplit(url)
    return urlunsplit(parts._replace(netloc=parts.netloc.rpartition("@")[2], query=""))
