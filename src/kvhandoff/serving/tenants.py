"""Tenants of the server's caches: the namespace a request's cached prefixes and sessions live in
(`namespace_of`), one radix tree of `prefix_tree.PrefixTree` per namespace, so no tenant is served another's."""

from __future__ import annotations

import hashlib
import json

from kvhandoff.errors import ConfigError

#: the namespace of a request that names no tenant
DEFAULT_NAMESPACE = "default"


def namespace_of(api_key: str | None = None, user: str | None = None, cache_salt: str | None = None,
                 default: str = DEFAULT_NAMESPACE) -> str:
    """The namespace of a request's cached prefixes: every tenant mark it carries — its API key (hashed: the tree
    never holds a key), its ``user``, its ``cache_salt`` — so a user under a key is a tenant of its own and a salt
    splits any of them further; ``default`` (the server's) when it carries none. Each kind has its own prefix, so a
    user named like a salt shares nothing with it, and several marks are joined as a JSON list, so no value can
    pass for two."""
    for value, what in ((api_key, "api_key"), (user, "user"), (cache_salt, "cache_salt")):
        if value is not None and not isinstance(value, str):
            raise ConfigError(f"{what} must be a string, got {type(value).__name__}")
    parts = []
    if api_key:
        parts.append("key:" + hashlib.sha256(api_key.encode()).hexdigest()[:32])
    if user:
        parts.append("user:" + user)
    if cache_salt:
        parts.append("salt:" + cache_salt)
    if len(parts) > 1:
        return json.dumps(parts)
    if parts:
        return parts[0]
    if not isinstance(default, str) or not default:
        raise ConfigError(f"the default namespace must be a non-empty string, got {default!r}")
    return default
