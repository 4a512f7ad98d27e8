"""Every Redis client pdserve opens: `redis://` or `rediss://` (TLS), AUTH from the URL or from a password file.

The password may sit in the URL (`redis://user:pass@host:6379/0`, e.g. a mounted Secret holding the whole URL) or
in a file of its own (`--redis-password-file`, env PDSERVE_REDIS_PASSWORD_FILE) with the username, if any, in the
URL; never both (which one would win is not something to guess). `--redis-ca-file` verifies a `rediss://` server
against that CA instead of the system roots.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

import redis.asyncio as aioredis

from pdserve.services.internal_security import ConfigError

SCHEMES = ("redis", "rediss", "unix")


@dataclass(frozen=True)
class RedisAuth:
    password: str | None = None
    ca_file: str | None = None

    @classmethod
    def from_files(cls, password_file: str | None = None, ca_file: str | None = None) -> "RedisAuth":
        password = None
        if password_file:
            try:
                password = Path(password_file).read_text().strip()
            except (OSError, UnicodeDecodeError) as e:
                raise ConfigError(f"--redis-password-file {password_file}: {getattr(e, 'strerror', None) or e}") \
                    from None
            if not password:
                raise ConfigError(f"--redis-password-file {password_file}: empty")
        if ca_file and not Path(ca_file).is_file():
            raise ConfigError(f"--redis-ca-file {ca_file}: no such file")
        return cls(password, ca_file)

    @classmethod
    def from_args(cls, args) -> "RedisAuth":
        return cls.from_files(getattr(args, "redis_password_file", None), getattr(args, "redis_ca_file", None))

    def check(self, url: str) -> None:
        u = urlparse(url)
        if u.scheme not in SCHEMES:
            raise ConfigError(f"--redis-url {url.split('@')[-1]!r}: the scheme must be redis://, rediss:// (TLS) "
                              "or unix://")
        if self.password and u.password:
            raise ConfigError("the Redis password is both in --redis-url and in --redis-password-file: keep one")
        if self.ca_file and u.scheme != "rediss":
            raise ConfigError("--redis-ca-file is for a rediss:// (TLS) URL")


NO_AUTH = RedisAuth()


def connect(url: str, auth: RedisAuth = NO_AUTH, **kwargs) -> aioredis.Redis:
    """A client for `url`; kwargs are redis-py's (timeouts)."""
    auth.check(url)
    if auth.password:
        kwargs["password"] = auth.password
    if auth.ca_file:
        kwargs["ssl_ca_certs"] = auth.ca_file
    return aioredis.from_url(url, **kwargs)
