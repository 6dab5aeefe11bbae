"""A family's switch settings (`kvhandoff.runtime.switch.pair.SwitchSettings`): the policy of a run reused at
another offset is parsed once and checked against what that reuse can rank by."""

from __future__ import annotations

import pytest

from kvhandoff.errors import ConfigError
from kvhandoff.runtime.offset import DEFAULT_OFFSET_RECOMPUTE
from kvhandoff.runtime.policy import TurnAttention
from kvhandoff.runtime.switch.pair import SwitchSettings


def test_the_offset_policy_may_rank_by_the_holders_read_but_not_by_the_source_history_queries():
    assert SwitchSettings().offset_recompute == DEFAULT_OFFSET_RECOMPUTE
    assert SwitchSettings(offset_recompute="turn_attention:10%").offset_recompute == TurnAttention(0.1)
    assert SwitchSettings(offset_recompute="blend:20%").to_dict()["offset_recompute"] == "blend:20%"
    with pytest.raises(ConfigError, match="ranks by the source's attention"):
        SwitchSettings(offset_recompute="source_attention:10%")
    with pytest.raises(ConfigError, match="budget"):
        SwitchSettings(offset_recompute="blend:x")
