"""The namespaces of the server's caches (kvhandoff.serving.tenants): every tenant mark of a request kept apart."""

from __future__ import annotations

import pytest

from kvhandoff.errors import ConfigError
from kvhandoff.serving.tenants import namespace_of


def test_namespace_of_joins_the_api_key_user_and_salt():
    key = namespace_of(api_key="sk-secret")
    assert key.startswith("key:") and "sk-secret" not in key
    assert key != namespace_of(api_key="sk-other")
    everything = namespace_of(api_key="sk-secret", user="u", cache_salt="s")
    assert "sk-secret" not in everything and key in everything
    assert namespace_of(user="u\nsalt:s") != namespace_of(user="u", cache_salt="s")  # no value passes for two
    assert namespace_of(user='u", "salt:s') != namespace_of(user="u", cache_salt="s")
    assert len({everything, key, namespace_of(api_key="sk-secret", user="u"), namespace_of(user="u"),
                namespace_of(user="u", cache_salt="s")}) == 5
    assert namespace_of(cache_salt="u") == "salt:u" != namespace_of(user="u")
    assert namespace_of() == "default" and namespace_of(default="server") == "server"
    with pytest.raises(ConfigError):
        namespace_of(user=3)
