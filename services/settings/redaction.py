"""Secrets out of what pdserve prints: a URL's password becomes ``***`` in logs, errors and
``pdserve status`` (the URL itself is still needed to connect)."""

from __future__ import annotations

from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from pdserve.settings.redis_url import is_sentinel, parse_sentinel_url

MASK = "***"
# Query parameters that redis-py reads as credentials.
_SECRET_PARAMS = ("password",)


def redact_url(url: str | None) -> str | None:
    """``url`` with its password (in the user-info part or a ``password=`` parameter)
    replaced by ``***``; a URL that cannot be parsed is masked whole."""
    if not url:
        return url
    if is_sentinel(url):  # several hosts: not a URL urlsplit reads
        try:
            return parse_sentinel_url(url).redacted(MASK)
        except ValueError:
            return MASK
    try:
        parts = urlsplit(url)
        password = parts.password
        hostname = parts.hostname
        port = parts.port
    except ValueError:
        return MASK
    netloc = parts.netloc
    if password is not None:
        user = parts.username or ""
        host = hostname or ""
        if ":" in host:
            host = f"[{host}]"
        netloc = f"{user}:{MASK}@{host}" + (f":{port}" if port is not None else "")
    query = parts.query
    pairs = parse_qsl(query, keep_blank_values=True)
    if any(k.lower() in _SECRET_PARAMS for k, _ in pairs):
        query = urlencode(
            [(k, MASK if k.lower() in _SECRET_PARAMS else v) for k, v in pairs], safe="*"
        )
    return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))
