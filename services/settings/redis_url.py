"""Redis Sentinel URLs, read without redis-py (the settings check them at start).

``redis+sentinel://[[USER]:PASSWORD@]HOST:PORT[,HOST:PORT...]/SERVICE[/DB]`` names the
Sentinels to ask (port 26379 when left out), the master's service name and the database;
``rediss+sentinel://`` uses TLS to the Sentinels and the master alike. The user and
password are the master's; ``?sentinel_password=P`` is the Sentinels' own, when they ask
for one. ``pdserve.controlplane.registry.connect`` turns it into a client that asks the
Sentinels for the master and follows a failover.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from urllib.parse import parse_qsl, quote, unquote

SCHEMES = ("redis+sentinel", "rediss+sentinel")
DEFAULT_PORT = 26379
FORM = "redis+sentinel://[[USER]:PASSWORD@]HOST:PORT[,HOST:PORT...]/SERVICE[/DB]"


@dataclass(frozen=True)
class SentinelURL:
    sentinels: tuple[tuple[str, int], ...]
    service: str
    db: int = 0
    username: str | None = None
    password: str | None = field(default=None, repr=False)
    sentinel_password: str | None = field(default=None, repr=False)
    tls: bool = False

    def redacted(self, mask: str) -> str:
        """The URL with both passwords replaced by ``mask``."""
        scheme = SCHEMES[1] if self.tls else SCHEMES[0]
        auth = ""
        if self.password is not None:
            auth = f"{quote(self.username or '', safe='')}:{mask}@"
        elif self.username:
            auth = f"{quote(self.username, safe='')}@"
        hosts = ",".join(f"[{h}]:{p}" if ":" in h else f"{h}:{p}" for h, p in self.sentinels)
        query = f"?sentinel_password={mask}" if self.sentinel_password is not None else ""
        return f"{scheme}://{auth}{hosts}/{self.service}/{self.db}{query}"


def is_sentinel(url: str | None) -> bool:
    return bool(url) and url.partition("://")[0].lower() in SCHEMES


def parse_sentinel_url(url: str) -> SentinelURL:
    """``url`` read as above; ValueError saying what is wrong (never echoing a password)."""
    scheme, _, rest = url.partition("://")
    if scheme.lower() not in SCHEMES:
        raise ValueError(f"not a Sentinel URL ({FORM})")
    rest, _, query = rest.partition("?")
    auth, at, location = rest.rpartition("@")
    hosts, _, path = location.partition("/")
    username = password = None
    if at:
        user, colon, secret = auth.partition(":")
        username = unquote(user) or None
        password = unquote(secret) if colon else None
    sentinels = tuple(_host_port(h) for h in hosts.split(",") if h) if hosts else ()
    if not sentinels:
        raise ValueError(f"a Sentinel URL names at least one Sentinel HOST:PORT ({FORM})")
    parts = [p for p in path.split("/") if p]
    if not parts or len(parts) > 2:
        raise ValueError(f"a Sentinel URL names the master's service, then a db ({FORM})")
    db = 0
    if len(parts) == 2:
        if not parts[1].isdigit():
            raise ValueError(f"the db of a Sentinel URL is a number, got {parts[1]!r}")
        db = int(parts[1])
    sentinel_password = None
    for key, value in parse_qsl(query, keep_blank_values=True):
        if key != "sentinel_password":
            raise ValueError(f"a Sentinel URL takes only ?sentinel_password=, not {key!r}")
        sentinel_password = value
    return SentinelURL(
        sentinels,
        unquote(parts[0]),
        db,
        username,
        password,
        sentinel_password,
        scheme.lower() == SCHEMES[1],
    )


def _host_port(text: str) -> tuple[str, int]:
    if text.startswith("["):
        host, _, port = text[1:].partition("]")
        port = port.removeprefix(":")
    else:
        host, _, port = text.rpartition(":") if ":" in text else (text, "", "")
    if not host:
        raise ValueError(f"a Sentinel address has no host: {text!r}")
    if port and not port.isdigit():
        raise ValueError(f"a Sentinel address's port is a number: {text!r}")
    return host, int(port) if port else DEFAULT_PORT
