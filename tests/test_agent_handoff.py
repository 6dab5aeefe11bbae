"""The OpenAI Agents SDK handoff bench over a real loopback server of the tiny family: the clerk's lookup and its
SDK handoff reach the analyst on the other model, whose history is found at another offset under "offset" and not
under "prefix"; the summary pairs the conditions; a rerun continues the stored result."""

import dataclasses
import json

import pytest

from _serving_support import AGENT_CONTEXT, tiny_family
from kvhandoff.runtime.switch.pair import SwitchSettings
from kvhandoff.serving.settings import ServeConfig

pytest.importorskip("agents")

from kvhandoff_lab.serving.agent_handoff import CONDITIONS, handoff_problems, run_handoff_bench

pytestmark = pytest.mark.timeout(300)


def test_the_analysts_history_is_found_at_another_offset_only_when_the_server_may(tmp_path):
    family, mappers = tiny_family(AGENT_CONTEXT)
    problems = [dataclasses.replace(problem, story=problem.story[:300]) for problem in handoff_problems(3)]
    out = tmp_path / "handoff.json"
    config = ServeConfig(switch=SwitchSettings(guard=False))
    first = run_handoff_bench(family, mappers, config, problems[:1], out=out)
    assert first["summary"]["problems"] == 1
    result = run_handoff_bench(family, mappers, config, problems, out=out)
    assert result["summary"]["problems"] == 3 and json.loads(out.read_text())["problems"] == result["problems"]
    for entry in result["problems"].values():
        assert [request["model"] for request in entry["offset"]["requests"]] == ["small", "small", "large"]
        assert entry["offset"]["reuse"] == "offset" and entry["prefix"]["reuse"] != "offset"
        assert entry["offset"]["kv_handoff"]["reuse"] == "offset"
        assert entry["offset"]["cached_tokens"] > entry["prefix"]["cached_tokens"]
    assert [entry["first_of_server"] for entry in result["problems"].values()] == [True, True, False]
    later = result["summary"]["after_first"]  # the third: the analyst's instructions cached by the second
    assert later["offset"]["share"] > 0.85 > later["prefix"]["share"]
    assert set(later) >= {*CONDITIONS, "speedup", "f1_offset_minus_prefix"}
