"""`kvhandoff-lab bench-vllm` without vLLM: the switch's FLOP bound, the load steps read from a connector's log, the
table, and the refusal when the vLLM environment is missing (the run itself needs the real pair: RESULTS.md)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import httpx
import pytest

from kvhandoff.errors import ConfigError
from kvhandoff.vllm.launch import vllm_python
from kvhandoff_lab.bench import continuation_flops, prefill_flops
from kvhandoff_lab.vllm_bench import VllmAnswers, VllmServer, _load_steps, scattered_flops, switch_flops, vllm_table

TARGET = {"body_parameters": 1_000_000, "layers": 4, "q_width": 256, "lm_head": 500_000}
SOURCE = {"body_parameters": 300_000, "layers": 2, "q_width": 128, "lm_head": 500_000}


def test_the_flop_bound_is_the_prefill_over_the_map_and_what_vllm_computes():
    whole = switch_flops(TARGET, 10_000, 1024, 1024)
    assert whole == 10_000 * 1024 + continuation_flops(TARGET, 1024, 0)
    tail = switch_flops(TARGET, 10_000, 1024, 896)  # the latest 128 positions recomputed
    assert tail > whole
    assert prefill_flops(TARGET, 1024) / whole > prefill_flops(TARGET, 1024) / tail > 1
    assert switch_flops(TARGET, 10_000, 1024, 0) == continuation_flops(TARGET, 0, 1024) == prefill_flops(TARGET, 1024)
    # the load step: its recomputed positions through the target, the source's read of the rest of the prompt
    scattered = switch_flops(TARGET, 10_000, 1056, 1024, recomputed=102)
    assert scattered == switch_flops(TARGET, 10_000, 1056, 1024) + scattered_flops(TARGET, 102, 1024)
    assert scattered_flops(TARGET, 102, 1024) == 2 * 1_000_000 * 102 + 2 * 2 * 4 * 256 * 102 * 512
    read = switch_flops(TARGET, 10_000, 1056, 1024, recomputed=102, source=SOURCE)
    assert read == scattered + continuation_flops(SOURCE, 1024, 32)


def test_load_steps_are_read_for_the_tenant_asked(tmp_path):
    log = tmp_path / "vllm.log"
    log.write_text(
        "INFO kvhandoff.vllm[1]: loaded 256 tokens (positions 0..255) for request a: K/V of 'small' mapped to "
        "'large', tenant 'other' (store 0.010 s, map 0.200 s, write 0.030 s)\n"
        "INFO kvhandoff.vllm[1]: loaded 192 tokens (positions 0..191) for request b: K/V of 'small' mapped to "
        "'large', its latest 64 positions recomputed by vLLM, tenant 'mine' (store 0.020 s, map 0.100 s, "
        "write 0.005 s)\n"
        "INFO kvhandoff.vllm[1]: loaded 256 tokens (positions 0..255) for request c: K/V of 'small' mapped to "
        "'large', 30 positions recomputed in the load step (turn_attention:10%), tenant 'step' (store 0.020 s, map "
        "0.100 s, recompute 0.400 s, write 0.005 s)\n")
    server = VllmServer("large", "http://127.0.0.1:1", log, None)
    assert _load_steps(server, "mine") == {"loaded_tokens": 192, "store": 0.02, "map": 0.1, "write": 0.005}
    assert _load_steps(server, "step") == {"loaded_tokens": 256, "recomputed_positions": 30, "store": 0.02,
                                           "map": 0.1, "recompute": 0.4, "write": 0.005}
    assert _load_steps(server, "absent") == {}


def test_the_table_has_a_row_per_measurement():
    row = {"direction": "a->b", "tokens": 1056, "recompute": "recent:5%", "own_ttft_s": 4.0, "switch_ttft_s": 0.5,
           "speedup": 8.0, "flop_bound": 10.0, "share_of_bound": 0.8, "steps_s": {"store": 0.1, "map": 0.2},
           "vllm_forward_s": 0.2, "own_decode_tok_s": 9.5, "switch_decode_tok_s": None}
    lines = vllm_table({"rows": [row]})
    assert len(lines) == 3 and "| a->b | 1056 | recent:5% | 4.00 s | 0.50 s | 8.0× | 10.0× | 0.80 |" in lines[2]
    assert "0.10 / 0.20 / 0.00 / 0.00 / 0.20 s | 9.5 / – |" in lines[2]


def test_a_missing_vllm_environment_is_refused_naming_the_fix(monkeypatch, tmp_path):
    monkeypatch.setenv("KVHANDOFF_VLLM_PYTHON", str(tmp_path / "nowhere" / "python"))
    with pytest.raises(ConfigError, match=r"setup\.sh"):
        vllm_python()
    result = subprocess.run([sys.executable, "-m", "kvhandoff_lab.cli", "bench-vllm", "--lengths", "128"],
                            capture_output=True, text=True,
                            env={**os.environ, "KVHANDOFF_VLLM_PYTHON": str(tmp_path / "python")})
    assert result.returncode != 0 and "setup.sh" in result.stdout + result.stderr


def test_vllm_answers_read_the_history_on_the_source_then_switch_under_one_fresh_tenant():
    sent = []

    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        sent.append((request.url.port, body))
        text = "x" if body["max_tokens"] == 1 else " Paris.\nQ: next"
        return httpx.Response(200, json={"choices": [{"text": text}]})

    servers = {"a": VllmServer("a", "http://127.0.0.1:1001", None, None),
               "b": VllmServer("b", "http://127.0.0.1:1002", None, None)}
    answers = VllmAnswers(servers, recompute="none", client=httpx.Client(transport=httpx.MockTransport(handler)))
    item = SimpleNamespace(history=SimpleNamespace(ids=(1, 2, 3), key="h1"), extension=(4,), question=(5, 6))
    assert answers.answers(item, "a", "b", 24, ["\nQ:"]) == {"target": " Paris.", "switch": " Paris."}
    (own_port, own), (source_port, read), (target_port, switched) = sent
    assert own_port == target_port == 1002 and source_port == 1001
    assert own["prompt"] == switched["prompt"] == [1, 2, 3, 4, 5, 6] and read["prompt"] == [1, 2, 3, 4]
    assert own["cache_salt"] == "own-h1" and own["kv_transfer_params"] == {"save": False}
    assert read["cache_salt"] == switched["cache_salt"] and read["cache_salt"].startswith("switch-")
    assert switched["kv_transfer_params"] == {"recompute": "none"} and switched["stop"] == ["\nQ:"]
    assert read["max_tokens"] == 1 and switched["temperature"] == 0


def test_eval_vllm_refuses_a_policy_vllm_cannot_serve_before_any_model_loads():
    result = subprocess.run([sys.executable, "-m", "kvhandoff_lab.cli", "eval-vllm", "--recompute", "sinks:10%",
                             "--no-scattered-recompute"],
                            capture_output=True, text=True, env={**os.environ, "KVHANDOFF_VLLM_PYTHON": sys.executable},
                            timeout=120)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "a vLLM target recomputes by the rules recent" in result.stdout + result.stderr
