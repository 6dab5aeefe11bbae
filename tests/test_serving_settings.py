"""The server's settings: every field checked where it enters, with a message naming it; plain values out."""

from __future__ import annotations

import pytest

from kvhandoff.errors import ConfigError
from kvhandoff.runtime.switch.pair import SwitchSettings
from kvhandoff.serving.settings import GENERATION_CONFIG_SOURCES, ServeConfig


@pytest.mark.parametrize(("settings", "message"), [
    ({"port": 70000}, "port must be an integer in 0..65535"),
    ({"host": ""}, "host must be a non-empty string"),
    ({"max_batch": 0}, "max_batch"),
    ({"read_timeout_s": -1.0}, "read_timeout_s"),
    ({"api_key": ("ok", " ")}, "api_key must be a non-empty string"),
    ({"handover": "some"}, "handover must be 'all' or 'incremental'"),
    ({"generation_config": "model"}, "generation_config must be one of auto, vllm"),
    ({"log_level": "loud"}, "log_level must be a uvicorn log level"),
    ({"switch": {"recompute": "recent:5%"}}, "switch must be a SwitchSettings"),
])
def test_bad_settings_are_refused_naming_the_field(settings, message):
    with pytest.raises(ConfigError, match=message):
        ServeConfig(**settings)


def test_settings_as_plain_values_hold_the_switch_and_never_the_key():
    config = ServeConfig(api_key="secret", generation_config="vllm", switch=SwitchSettings(recompute="recent:5%"))
    plain = config.to_dict()
    assert plain["api_key"] == "1 set" and "secret" not in str(plain)
    assert plain["recompute"] == "recent:5%" and plain["generation_config"] == "vllm"
    assert ServeConfig().generation_config == GENERATION_CONFIG_SOURCES[0] == "auto"
