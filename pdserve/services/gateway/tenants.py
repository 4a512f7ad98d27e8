"""Tenants and their API keys, read from a JSON or YAML file (in Kubernetes: a Secret mounted as a file).

```yaml
tenants:
  acme:
    keys: ["sk-acme-1", "sk-acme-2"]
    rate_rps: 5            # token bucket: requests per second refilled ...
    burst: 10              # ... up to this many at once (default: max(1, rate_rps))
    quota_tokens: 200000   # prompt + completion tokens per quota window (0: unlimited)
    quota_window_s: 3600
    priority: 1            # scheduling class, lower = more urgent (engine policy `priority`)
    shared_namespace: docs # opt-in: share prefix-cache blocks with every tenant naming the same namespace
    kv_share: 0.25         # guaranteed fraction of the KV capacity (admission) and of each worker's blocks
                           # (prefix-cache eviction); the sum over tenants must be <= 1 (default 0)
    kv_max_share: 1.0      # the most it may hold, borrowing others' idle guarantees and the surplus included
    kv_idle_s: 30          # its guarantee is held back this long after its last request (then borrowable)
    permissions: []        # operator rights, none by default: `metrics` (read GET /metrics),
                           # `debug_route` (the `x-pdserve-debug: route` header is honoured),
                           # `debug_stage_times` (`usage.stage_times` when the request asks for it)
```
With no file configured, every request is tenant `default` (no key needed, no limits, namespace ""). With a file,
a missing or unknown key is 401. Keys are held only as SHA-256 digests, and looked up by digest, so the lookup
time does not depend on how much of a guessed key matches a real one.
Without a keys file there is no authentication at all (one trust domain: a dev box, or a deployment behind an
authenticating proxy), so the one `default` tenant holds every permission (docs/admission.md, "Trust model").
The file is re-read when its mtime changes (a rotated Secret), at most every `reload_s`.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from pdserve.services.kv_shares import KVShare

log = logging.getLogger("pdserve.gateway")


@dataclass
class Tenant:
    name: str
    rate_rps: float = 0.0  # 0: no rate limit
    burst: float = 0.0
    quota_tokens: int = 0  # 0: no quota
    quota_window_s: float = 3600.0
    priority: int = 1
    shared_namespace: str | None = None
    max_timeout_s: float | None = None  # cap on the request's own `timeout`
    kv_share: float = 0.0       # guaranteed KV fraction (docs/admission.md, "Tenant KV shares")
    kv_max_share: float = 1.0   # cap, borrowing included
    kv_idle_s: float = 30.0     # guarantee held back this long after its last request
    # operator rights (PERMISSIONS); a plain API key has none, so /metrics and routing internals stay hidden from it
    permissions: frozenset[str] = frozenset()
    key_digests: list[str] = field(default_factory=list)

    def can(self, permission: str) -> bool:
        return permission in self.permissions

    @property
    def namespace(self) -> str:
        """Prefix-cache namespace: the tenant's own unless it opted into a shared one (spec §4.3, Q22)."""
        return self.shared_namespace if self.shared_namespace is not None else f"tenant:{self.name}"

    @property
    def kv(self) -> KVShare:
        return KVShare(self.name, self.kv_share, self.kv_max_share, self.kv_idle_s)

    @property
    def bucket_size(self) -> float:
        return self.burst if self.burst > 0 else max(1.0, self.rate_rps)


PERMISSIONS = frozenset({"metrics", "debug_route", "debug_stage_times"})
# no keys file: one namespace, as before, and nobody to tell apart, so every permission
DEFAULT_TENANT = Tenant("default", priority=1, shared_namespace="", permissions=PERMISSIONS)


def digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def parse(data: dict) -> list[Tenant]:
    tenants = data.get("tenants", data)
    if not isinstance(tenants, dict):
        raise ValueError("api keys file: 'tenants' must map tenant names to settings")
    out = []
    for name, cfg in tenants.items():
        cfg = dict(cfg or {})
        keys = cfg.pop("keys", [])
        if isinstance(keys, str):
            keys = [keys]
        perms = cfg.pop("permissions", [])
        if isinstance(perms, str):
            perms = [perms]
        if not isinstance(perms, list) or not all(isinstance(x, str) and x in PERMISSIONS for x in perms):
            raise ValueError(f"api keys file: tenant {name!r}: permissions must be a list of {sorted(PERMISSIONS)}")
        allowed = {f for f in Tenant.__dataclass_fields__ if f not in ("name", "key_digests", "permissions")}
        unknown = set(cfg) - allowed
        if unknown:
            raise ValueError(f"api keys file: tenant {name!r}: unknown settings {sorted(unknown)}")
        t = Tenant(name=str(name), key_digests=[digest(str(k)) for k in keys], permissions=frozenset(perms), **cfg)
        _check_kv(t)
        out.append(t)
    total = sum(t.kv_share for t in out)
    if total > 1.0 + 1e-9:
        raise ValueError(f"api keys file: the tenants' kv_share add up to {total:g} > 1 (guarantees must fit the "
                         f"capacity): " + ", ".join(f"{t.name}={t.kv_share:g}" for t in out if t.kv_share))
    return out


def _check_kv(t: Tenant) -> None:
    for f in ("kv_share", "kv_max_share", "kv_idle_s"):
        v = getattr(t, f)
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ValueError(f"api keys file: tenant {t.name!r}: {f} must be a number, got {v!r}")
    if not 0.0 <= t.kv_share <= t.kv_max_share <= 1.0:
        raise ValueError(f"api keys file: tenant {t.name!r}: need 0 <= kv_share ({t.kv_share:g}) <= kv_max_share "
                         f"({t.kv_max_share:g}) <= 1")
    if t.kv_idle_s < 0:
        raise ValueError(f"api keys file: tenant {t.name!r}: kv_idle_s must be >= 0, got {t.kv_idle_s:g}")


PLAIN_KEYS_TENANT = "default"  # the tenant of a file that is only keys, one per line


def _plain_keys(text: str) -> list[str] | None:
    """The keys of a one-key-per-line file (blank and `#` lines skipped), or None when a line is not a bare key
    (whitespace or ':' inside: a YAML mapping or list, or a malformed line)."""
    lines = [ln.strip() for ln in text.splitlines()]
    keys = [ln for ln in lines if ln and not ln.startswith("#")]
    if keys and all(not any(c.isspace() or c == ":" for c in k) for k in keys):
        return keys
    return None


def load_file(path: str | Path) -> list[Tenant]:
    """Tenants from `path`: JSON (`.json`), YAML (`.yaml`/`.yml`), or, under any other name (a Secret key such as
    `api-keys`), by content: a JSON/YAML tenants mapping, or plain keys one per line, all of tenant `default`
    (no limits). Anything else is a ValueError naming the file and both formats."""
    text = Path(path).read_text()
    name = str(path)
    if not name.endswith((".json", ".yaml", ".yml")) and not text.lstrip().startswith("{"):
        keys = _plain_keys(text)
        if keys is not None:
            return [Tenant(PLAIN_KEYS_TENANT, key_digests=[digest(k) for k in keys])]
    try:
        if name.endswith(".json") or text.lstrip().startswith("{"):
            data = json.loads(text)
        else:
            import yaml
            data = yaml.safe_load(text) or {}
    except ValueError as e:
        raise ValueError(f"api keys file {name}: not valid JSON: {e}") from None
    except Exception as e:  # yaml.YAMLError: not a ValueError, so a reload would not catch it
        raise ValueError(f"api keys file {name}: not valid YAML: {e}") from None
    if not isinstance(data, dict):
        bad = next((ln for ln in text.splitlines() if ln.strip() and not ln.strip().startswith("#")
                    and any(c.isspace() or c == ":" for c in ln.strip())), None)
        raise ValueError(f"api keys file {name}: expected a tenants mapping (`tenants: {{NAME: {{keys: [...]}}}}`) "
                         f"or one key per line" + (f"; line {bad.strip()!r} is neither" if bad else ""))
    tenants = data.get("tenants", data)
    for tname, cfg in (tenants.items() if isinstance(tenants, dict) else ()):
        if cfg is not None and not isinstance(cfg, dict):  # e.g. a `key:with-colon` line read as YAML
            raise ValueError(f"api keys file {name}: tenant {tname!r}: settings must be a mapping "
                             f"(`{{keys: [...], rate_rps: ...}}`), got {type(cfg).__name__}")
    return parse(data)


class TenantDirectory:
    def __init__(self, path: str | None = None, reload_s: float = 5.0):
        self.path = path or None
        self.reload_s = reload_s
        self._by_digest: dict[str, Tenant] = {}
        self._mtime = 0.0
        self._checked = 0.0
        if self.path:
            self._load()

    @property
    def required(self) -> bool:
        return self.path is not None

    def _load(self) -> None:
        tenants = load_file(self.path)
        self._by_digest = {d: t for t in tenants for d in t.key_digests}
        self._mtime = os.stat(self.path).st_mtime
        log.info("loaded %d tenants (%d keys) from %s", len(tenants), len(self._by_digest), self.path)

    def _maybe_reload(self) -> None:
        now = time.monotonic()
        if now - self._checked < self.reload_s:
            return
        self._checked = now
        try:
            if os.stat(self.path).st_mtime != self._mtime:
                self._load()
        except (OSError, ValueError) as e:  # keep serving with the keys we have
            log.warning("api keys file %s not reloaded: %s", self.path, e)

    def authenticate(self, api_key: str | None) -> Tenant | None:
        """The key's tenant; DEFAULT_TENANT when no file is configured; None for a missing/unknown key."""
        if not self.required:
            return DEFAULT_TENANT
        self._maybe_reload()
        if not api_key:
            return None
        return self._by_digest.get(digest(api_key))
