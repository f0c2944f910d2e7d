"""What the L2 tiers share below the tiers themselves: their errors, the URL parameter helpers, and
the redis-py glue of the Redis and Redis Cluster tiers (options from a URL, errors translated,
the package imported on demand). ``l2`` (disk and Redis tiers, ``open_tier``) and ``l2_cluster``
both build on it, and neither imports the other's privates."""
from __future__ import annotations

import os
import stat
import urllib.parse
from typing import Any

DEFAULT_REDIS_PREFIX = b"mpcache:"
DEFAULT_REDIS_TIMEOUT_S = 2.0
DEFAULT_REDIS_POOL = 16


class L2Error(Exception):
    """An L2 tier could not do what was asked (I/O error, bad URL, tier closed, ...)."""


class L2Unavailable(L2Error):
    """The service behind an L2 tier cannot be reached (connection refused, timeout)."""


def split_params(rest: str) -> tuple[str, dict[str, str]]:
    base, _, query = rest.partition("?")
    params: dict[str, str] = {}
    for name, value in urllib.parse.parse_qsl(query, keep_blank_values=True):
        params[name] = value
    return base, params


def reject_unknown(url: str, params: dict[str, str], known: set[str]) -> None:
    unknown = sorted(set(params) - known)
    if unknown:
        raise L2Error(
            f"L2 URL {redact(url)!r}: unknown parameter(s) {', '.join(unknown)}; "
            f"known: {', '.join(sorted(known))}"
        )


def param_int(url: str, params: dict[str, str], name: str) -> int:
    try:
        value = int(params[name])
    except ValueError:
        raise L2Error(f"L2 URL {redact(url)!r}: {name} must be an integer") from None
    if value <= 0:
        raise L2Error(f"L2 URL {redact(url)!r}: {name} must be positive")
    return value


def param_float(url: str, params: dict[str, str], name: str) -> float:
    try:
        value = float(params[name])
    except ValueError:
        raise L2Error(f"L2 URL {redact(url)!r}: {name} must be a number") from None
    if not value > 0:
        raise L2Error(f"L2 URL {redact(url)!r}: {name} must be positive")
    return value


def param_bool(url: str, params: dict[str, str], name: str, default: bool) -> bool:
    if name not in params:
        return default
    value = params[name].lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise L2Error(f"L2 URL {redact(url)!r}: {name} must be 0 or 1")


def redact(url: str) -> str:
    """The URL without its password (``user:***@``), for messages and `name`. Works on any URL
    shape, including cluster URLs with several hosts that urllib cannot parse."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url
    netloc, slash, tail = rest.partition("/")
    userinfo, at, hosts = netloc.rpartition("@")
    if not at:
        return url
    user, colon, _password = userinfo.partition(":")
    redacted = f"{user}:***@" if colon else f"{user}@"
    return f"{scheme}://{redacted}{hosts}{slash}{tail}"


REDIS_PARAMS = {"ttl", "timeout", "pool", "prefix", "password_file", "ca", "cert", "key"}


def redis_options(url: str, params: dict[str, str]) -> dict[str, Any]:
    """The tier options and redis-py connection keywords a Redis URL's parameters name."""
    reject_unknown(url, params, REDIS_PARAMS)
    out: dict[str, Any] = {
        "ttl_s": param_int(url, params, "ttl") if "ttl" in params else None,
        "timeout_s": param_float(url, params, "timeout") if "timeout" in params else DEFAULT_REDIS_TIMEOUT_S,
        "pool_size": param_int(url, params, "pool") if "pool" in params else DEFAULT_REDIS_POOL,
        "prefix": params["prefix"].encode() if "prefix" in params else DEFAULT_REDIS_PREFIX,
    }
    conn: dict[str, Any] = {}
    if "password_file" in params:
        conn["password"] = read_password_file(url, params["password_file"])
    tls = {"ca": "ssl_ca_certs", "cert": "ssl_certfile", "key": "ssl_keyfile"}
    for name, kw in tls.items():
        if name in params:
            if not url.split("://", 1)[0].lower().startswith(("rediss", "valkeys")):
                raise L2Error(f"L2 URL {redact(url)!r}: {name}= needs a TLS scheme (rediss://)")
            conn[kw] = params[name]
    out["connection_kwargs"] = conn
    return out


def read_password_file(url: str, path: str) -> str:
    try:
        st = os.stat(path)
        with open(path, encoding="utf-8") as f:
            password = f.read().strip("\r\n")
    except OSError as e:
        raise L2Error(f"L2 URL {redact(url)!r}: password_file: {e}") from None
    if st.st_mode & 0o077:
        raise L2Error(
            f"L2 URL {redact(url)!r}: password_file {path} has mode {stat.S_IMODE(st.st_mode):04o}; "
            f"it must not be accessible to group or others (chmod 600 it)"
        )
    if not password:
        raise L2Error(f"L2 URL {redact(url)!r}: password_file {path} is empty")
    return password


def translate_redis_error(redis: Any, name: str, e: Exception, what: str) -> L2Error:
    """A redis-py exception as an `L2Error` (`L2Unavailable` when the service cannot be reached
    or refuses our credentials), with a message that names the tier and holds no password."""
    exc = redis.exceptions
    # AuthenticationError is a ConnectionError in redis-py: test it first.
    if isinstance(e, (exc.AuthenticationError, exc.NoPermissionError)):
        return L2Unavailable(f"redis tier {name}: authentication failed: {e}")
    if isinstance(e, exc.ResponseError) and str(e).startswith(("NOAUTH", "WRONGPASS", "NOPERM")):
        return L2Unavailable(f"redis tier {name}: not authorized: {e}")
    if isinstance(e, (exc.ConnectionError, exc.TimeoutError)) or type(e).__name__ in (
            "ClusterDownError", "MasterDownError", "SlotNotCoveredError", "TryAgainError"):
        return L2Unavailable(f"redis tier {name}: unreachable ({what}): {e}")
    return L2Error(f"redis tier {name}: {what} failed: {e}")


def import_redis() -> Any:
    try:
        import redis
    except ImportError:
        raise L2Error(
            "redis tier: the redis package is not installed (pip install 'mpcache[redis]')"
        ) from None
    return redis
