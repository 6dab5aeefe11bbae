"""A result file a rerun continues (`kvhandoff_lab.resume`): taken up only under the same settings."""

import json

from kvhandoff_lab.resume import stored_part


def test_a_stored_part_is_taken_up_only_under_the_same_settings(tmp_path):
    out = tmp_path / "result.json"
    assert stored_part(out, {"format": "x/1"}) == {}  # no file yet
    out.write_text(json.dumps({"format": "x/1", "task": "coqa", "records": {"a": 1}, "problems": {"p": 2}}))
    assert stored_part(out, {"format": "x/1", "task": "coqa"}) == {"a": 1}
    assert stored_part(out, {"format": "x/1"}, "problems") == {"p": 2}
    assert stored_part(out, {"format": "x/1", "task": "nq_open"}) == {}  # other settings: started afresh
    assert stored_part(out, {"format": "x/1", "limit": 8}) == {}  # a setting the file lacks
    assert stored_part(None, {}) == {}
