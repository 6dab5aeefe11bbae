"""kvhandoff inside vLLM: the connector (`kvhandoff.vllm.connector`) in real vLLM engines (the CPU build in
.venv-vllm, each engine a subprocess running tests/vllm_driver.py), K/V travelling through a Valkey/Redis server the
test starts on a free loopback port.

A tiny Qwen2 ("small", vLLM-compatible: hidden = heads × head_dim, head_dim 32) and an exactly related copy
("large": equal outputs, another cache) with exact mappers both ways, float32. One scenario, engines reused:
(a) a fresh engine of the small model loads the small model's saved K/V and answers as a normal run; (b) the large
model's engine loads the small model's K/V mapped and answers as its own run, and saves nothing of them as its own;
(c) another tenant's entry, a corrupt and a truncated entry are refused with a log line, vLLM prefills, same answer.
The store's entry format alone is tested without vLLM.
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from tests._serving_support import EXACT_FIT

from kvhandoff.errors import ConfigError
from kvhandoff.fit.pipeline import fit_mapper
from kvhandoff.runtime.policy import DEFAULT_RECOMPUTE, parse
from kvhandoff.vllm.family import (
    VLLM_CAPABILITIES,
    FamilyConfig,
    mapped_load_end,
    request_recompute,
    resolve_identities,
    tenant_of,
)
from kvhandoff.vllm.store import (
    EntryRefused,
    Expected,
    decode_entry,
    encode_entry,
    entry_key,
    local_store,
    prefix_hashes,
)

from conftest import chat_tokenizer, exactly_related, random_batches, tiny_model

REPO = Path(__file__).resolve().parents[1]
VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"
DRIVER = Path(__file__).resolve().parent / "vllm_driver.py"
BLOCK = 128  # vLLM's CPU block size
PROMPT = [(7 * i + 3) % 256 for i in range(300)]  # 2 full blocks + 44 tokens
TOKENS = 16


# -- the entry format (no vLLM) -----------------------------------------------------------------------------------

def test_store_entry_round_trip_and_refusals():
    rows = torch.randn(2, 2, 256, 2, 32)
    prefix = prefix_hashes(PROMPT, BLOCK)[-1]
    value = encode_entry(rows, identity="m1", model_name="small", tenant="t", prefix=prefix)
    expected = Expected("m1", "t", prefix, 256, (2, 2, 32))
    assert torch.equal(decode_entry(value, expected), rows)
    assert entry_key("a:b", "m1", prefix) == f"kvhandoff:a%3Ab:m1:{prefix}"
    refusals = {
        "another model": (value, Expected("m2", "t", prefix, 256)),
        "another tenant": (value, Expected("m1", "u", prefix, 256)),
        "another prefix": (value, Expected("m1", "t", "0" * 40, 256)),
        "truncated": (value[:-100], expected),
        "checksum": (value[:-5] + bytes([value[-5] ^ 1]) + value[-4:], expected),
        "layers": (value, Expected("m1", "t", prefix, 256, (3, 2, 32))),
        "magic": (b"junk" + value, expected),
        "no entry": (None, expected),
    }
    for what, (data, want) in refusals.items():
        with pytest.raises(EntryRefused, match=what):
            decode_entry(data, want)
    half = encode_entry(rows.to(torch.bfloat16), identity="m1", model_name="small", tenant="t", prefix=prefix)
    assert torch.equal(decode_entry(half, expected), rows.to(torch.bfloat16))


def test_prefix_hashes_are_incremental():
    hashes = prefix_hashes(PROMPT, BLOCK)
    assert len(hashes) == 2 and hashes[0] == prefix_hashes(PROMPT[:BLOCK], BLOCK)[0]
    assert hashes[1] != prefix_hashes(PROMPT[:BLOCK] + [0] * BLOCK, BLOCK)[1]


# -- the family's switch policy (no vLLM) --------------------------------------------------------------------------

def test_a_switch_in_vllm_recomputes_the_latest_mapped_positions_only():
    assert mapped_load_end(0, 256, parse("recent:25%")) == 192
    assert mapped_load_end(128, 512, parse("recent:10%")) == 512 - 38  # a share of the 384 mapped positions
    assert mapped_load_end(0, 256, parse("none")) == 256
    assert mapped_load_end(0, 256, parse("recent:100%")) == 0
    assert VLLM_CAPABILITIES.serves(parse("recent:5%")) and not VLLM_CAPABILITIES.serves(parse("sinks:10%"))
    config = FamilyConfig.from_extra({"store_url": "redis://h:1/0", "model": "large", "recompute": "recent:5%",
                                      "mappers": {"small->large": "/m"}})
    assert config.switch.recompute.spec == "recent:5%" and config.incoming == {"small": "/m"}
    with pytest.raises(ConfigError, match="give one or the other"):
        FamilyConfig.from_extra({"store_url": "redis://h:1/0", "model": "large", "recompute": "recent:5%",
                                 "min_speedup": 5})
    with pytest.raises(ConfigError, match="name it 'SOURCE->TARGET'"):
        FamilyConfig.from_extra({"store_url": "redis://h:1/0", "model": "large", "mappers": {"small": "/m"}})
    assert config.map_dtype is None  # the instance's dtype
    assert FamilyConfig.from_extra({**{"store_url": "u", "model": "m"}, "map_dtype": "bfloat16"}).map_dtype == \
        torch.bfloat16
    with pytest.raises(ConfigError, match="map_dtype must be one of float32, bfloat16"):
        FamilyConfig.from_extra({"store_url": "u", "model": "m", "map_dtype": "fp8"})


def test_a_requests_tenant_and_recompute_come_from_its_transfer_params(caplog):
    pair = parse("recent:5%")
    plain = SimpleNamespace(request_id="r1", kv_transfer_params=None, cache_salt=None)
    assert tenant_of(plain, "default") == "default" and request_recompute(plain, pair) == pair
    salted = SimpleNamespace(request_id="r2", kv_transfer_params={"recompute": "none"}, cache_salt="salt")
    assert tenant_of(salted, "default") == "salt" and request_recompute(salted, pair) == parse("none")
    named = SimpleNamespace(request_id="r3", kv_transfer_params={"tenant": "t", "recompute": "sinks:10%"},
                            cache_salt="salt")
    with caplog.at_level("WARNING", logger="kvhandoff.vllm"):
        assert tenant_of(named, "default") == "t" and request_recompute(named, pair) == pair
    assert "request r3: kv_transfer_params recompute refused" in caplog.text and "recent:5%" in caplog.text


def test_each_incoming_pair_gets_the_policy_vllm_can_serve(tmp_path):
    _, large_path, mappers = _family(tmp_path)
    extra = {"store_url": "redis://h:1/0", "model": "large", "mappers": mappers}
    ids = resolve_identities(FamilyConfig.from_extra(extra), str(large_path), torch.float32)
    assert ids.recompute["small"].source == "default" and ids.recompute_policy("small") == DEFAULT_RECOMPUTE
    named = resolve_identities(FamilyConfig.from_extra({**extra, "recompute": "recent:30%"}), str(large_path),
                               torch.float32)
    assert named.recompute_policy("small").spec == "recent:30%" and named.recompute["small"].source == "configured"
    with pytest.raises(ConfigError, match="a vLLM target recomputes by the rules recent"):
        resolve_identities(FamilyConfig.from_extra({**extra, "recompute": "turn_attention:10%"}), str(large_path),
                           torch.float32)


# -- real engines -------------------------------------------------------------------------------------------------

class Engine:
    """A vLLM engine with the connector in a subprocess (tests/vllm_driver.py); every output line is kept."""

    def __init__(self, name: str, model: Path, store_url: str, mappers: dict, cpu: str, log: Path,
                 label: str | None = None, recompute: str | None = None, models: dict | None = None):
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": cpu,
               "VLLM_CPU_NUM_OF_RESERVED_CPU": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
               "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"}
        self.name = label or name
        self.log = log
        self.lines: list[str] = []
        self._replies: queue.Queue = queue.Queue()
        self._process = subprocess.Popen(
            [str(VLLM_PYTHON), str(DRIVER), "--model", str(model), "--name", name, "--store-url", store_url,
             "--mappers", json.dumps(mappers), *(["--recompute", recompute] if recompute else []),
             *(["--models", json.dumps({name: str(path) for name, path in models.items()})] if models else [])],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=REPO)
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        with open(self.log, "w") as log:
            for line in self._process.stdout:
                log.write(line)
                log.flush()
                self.lines.append(line)
                if line.startswith("KVH-REPLY "):
                    self._replies.put(json.loads(line[len("KVH-REPLY "):]))
        self._replies.put({"error": f"engine {self.name} exited (log: {self.log})"})

    def reply(self, timeout: float = 150.0) -> dict:
        try:
            answer = self._replies.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"engine {self.name}: no answer in {timeout} s; log {self.log}:\n"
                                 + "".join(self.lines[-40:])) from None
        assert "error" not in answer, f"engine {self.name}: {answer['error']}\n" + "".join(self.lines[-40:])
        return answer

    def ask(self, **command) -> tuple[dict, str]:
        """(the answer, the output lines printed while the command ran)."""
        start = len(self.lines)
        self._process.stdin.write(json.dumps(command) + "\n")
        self._process.stdin.flush()
        answer = self.reply()
        time.sleep(0.3)  # the engine core's and worker's log lines of this request
        return answer, "".join(self.lines[start:])

    def generate(self, tenant: str, prompt: list[int] = PROMPT, **extra) -> tuple[dict, str]:
        return self.ask(op="generate", prompt=prompt, tenant=tenant, max_tokens=TOKENS, **extra)

    def close(self) -> None:
        if self._process.poll() is None:
            try:
                self._process.stdin.write(json.dumps({"op": "quit"}) + "\n")
                self._process.stdin.flush()
                self._process.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                self._process.kill()
                self._process.wait()


def _family(folder: Path) -> tuple[Path, Path, dict]:
    """small, large (exactly related) as vLLM-loadable folders, and exact mappers both ways: {'A->B': folder}."""
    small = tiny_model("qwen2", layers=2, head_dim=32, kv_heads=2, heads=2, vocab_size=300, seed=5,
                       attn_implementation=None)
    large = exactly_related(small)
    for model in (small, large):
        config = model.config
        assert config.hidden_size == config.num_attention_heads * config.head_dim  # vLLM's Qwen2 reads no head_dim
    tokenizer = chat_tokenizer()
    paths = {}
    for name, model in (("small", small), ("large", large)):
        model.config.eos_token_id = tokenizer.eos_token_id
        model.config.bos_token_id = None
        model.generation_config.eos_token_id = tokenizer.eos_token_id
        model.save_pretrained(folder / name)
        tokenizer.save_pretrained(folder / name)
        paths[name] = folder / name
    mappers = {}
    for source, target, a, b in (("small", "large", small, large), ("large", "small", large, small)):
        path = folder / f"{source}-to-{target}"
        fit_mapper(a, b, random_batches(), EXACT_FIT, progress=False).save(path)
        mappers[f"{source}->{target}"] = str(path)
    return paths["small"], paths["large"], mappers


@pytest.fixture
def store(tmp_path):
    with local_store(tmp_path, max_memory="64mb") as url:
        yield url


def _same(answer: dict, reference: dict) -> None:
    assert answer["tokens"] == reference["tokens"]
    gap = max(abs(a - b) for a, b in zip(answer["logprobs"], reference["logprobs"], strict=True))
    assert gap < 1e-3, gap


@pytest.mark.skipif(not VLLM_PYTHON.exists(), reason=".venv-vllm is absent (made by `bash scripts/setup.sh`)")
@pytest.mark.timeout(600)
def test_vllm_connector_round_trip_switch_and_refusals(tmp_path, store):
    small_path, large_path, mappers = _family(tmp_path)
    logs = tmp_path / "logs"
    logs.mkdir()
    small = Engine("small", small_path, store, mappers, "0", logs / "small.log")
    large = Engine("large", large_path, store, mappers, "1", logs / "large.log", recompute="recent:25%",
                   models={"small": small_path})
    engines = [small, large]
    try:
        small.reply(timeout=240)
        large.reply(timeout=240)

        # the small model prefills the prompt itself and saves its own K/V of the 2 full blocks
        own_small, out = small.generate("t")
        assert own_small["cached"] == 0 and "saved 256 tokens of own K/V" in out, out
        # the large model's own run, under another tenant: the small model's entry (tenant t) is not used
        own_large, out = large.generate("ref", kv_transfer_params={"save": False})
        assert own_large["cached"] == 0 and "loaded" not in out and "saved" not in out, out
        assert large.ask(op="keys", pattern="kvhandoff:ref:*")[0]["keys"] == []  # "save": false

        # the large model earlier read another prompt of tenant t with the same opening: its own K/V of the first 4
        # positions (the mapper's exact prefix) are stored with its block
        _, out = large.generate("t", prompt=PROMPT[:4] + [(5 * i + 1) % 256 for i in range(200)])
        assert "saved 128 tokens of own K/V" in out, out

        # (b) a switch: the large model's engine loads the small model's K/V mapped but for the latest quarter, which
        # vLLM recomputes (recent:25% of 256 mapped positions), its opening's own rows in place of the mapped ones,
        # and answers as its own run
        assert "recompute for small → large: recent:25% (--recompute, for every pair)" in "".join(large.lines)
        switched, out = large.generate("t")
        assert switched["cached"] == 192, out
        assert "loaded 192 tokens (positions 0..191)" in out, out
        assert ("K/V of 'small' mapped to 'large', its first 4 positions the model's own, its latest 64 positions "
                "recomputed by vLLM") in out, out
        _same(switched, own_large)
        keys = large.ask(op="keys", pattern="kvhandoff:t:*")[0]["keys"]
        prompt_prefix = prefix_hashes(PROMPT, BLOCK)[-1]
        (entry,) = [key for key in keys if key.endswith(prompt_prefix)]  # mapped rows are never saved as the large's
        _, _, identity, prefix = entry.split(":")
        assert sum(key.split(":")[2] == identity for key in keys) == 2, keys  # the small model's block and opening

        # a request's own recompute policy (kv_transfer_params): none, the whole prefix mapped; one vLLM cannot serve
        # is refused with a log line and the pair's serves
        for tenant, asked, cached in (("n", "none", 256), ("s", "layers:50%", 192)):
            large.ask(op="copy", src=entry, dst=entry_key(tenant, identity, prefix), tenant=tenant, damage=None)
            answer, out = large.generate(tenant, kv_transfer_params={"recompute": asked})
            assert answer["cached"] == cached, out
            _same(answer, own_large)
        assert "kv_transfer_params recompute refused" in out and "served under the pair's recent:25%" in out, out

        # positions picked anywhere in the prefix (turn_attention, the small model's read of the new turn) are
        # recomputed in the load step by the connector's copies of both models: the whole prefix loads
        assert "the load step recomputes scattered positions with small from" in "".join(large.lines)
        large.ask(op="copy", src=entry, dst=entry_key("a", identity, prefix), tenant="a", damage=None)
        answer, out = large.generate("a", kv_transfer_params={"recompute": "turn_attention:50%"})
        assert answer["cached"] == 256 and "loaded 256 tokens (positions 0..255)" in out, out
        assert "130 positions recomputed in the load step (turn_attention:50%)" in out, out  # 4 + half of 252
        _same(answer, own_large)
        # vLLM's own prefix cache holds the first block (an earlier request of the tenant): the load step maps and
        # recomputes the second on vLLM's own rows of the first
        large.generate("b", prompt=PROMPT[:128] + [(3 * i + 2) % 256 for i in range(40)],
                       kv_transfer_params={"save": False})
        large.ask(op="copy", src=entry, dst=entry_key("b", identity, prefix), tenant="b", damage=None)
        answer, out = large.generate("b", kv_transfer_params={"recompute": "turn_attention:50%"})
        assert answer["cached"] == 256 and "loaded 128 tokens (positions 128..255)" in out, out
        assert "64 positions recomputed in the load step" in out, out
        _same(answer, own_large)

        # (a) a fresh engine of the small model loads its own saved K/V and answers as the normal run
        small.close()
        fresh = Engine("small", small_path, store, mappers, "0", logs / "small-fresh.log", label="small-fresh")
        engines.append(fresh)

        # (c) refusals, on the large model's engine while the fresh one starts; each served by vLLM's own prefill
        cases = {"u": (None, None, "another tenant's entry"), "v": ("v", "flip", "checksum mismatch"),
                 "w": ("w", "truncate", "truncated")}
        for tenant, (header_tenant, damage, reason) in cases.items():
            large.ask(op="copy", src=entry, dst=entry_key(tenant, identity, prefix), tenant=header_tenant,
                      damage=damage)
            answer, out = large.generate(tenant)
            assert "refused store entry" in out and reason in out, out
            assert answer["cached"] == 0, out
            _same(answer, own_large)

        fresh.reply(timeout=240)
        loaded, out = fresh.generate("t")
        assert loaded["cached"] == 256 and "own K/V" in out, out
        _same(loaded, own_small)
    finally:
        for engine in engines:
            engine.close()


# -- real clients against two vLLM OpenAI servers ------------------------------------------------------------------

@pytest.mark.skipif(not VLLM_PYTHON.exists(), reason=".venv-vllm is absent (made by `bash scripts/setup.sh`)")
@pytest.mark.timeout(600)
# LiteLLM's own typed dicts, as pydantic sees them: noise of the installed packages
@pytest.mark.filterwarnings("ignore:.*using the `ReadOnly` qualifier:UserWarning")
def test_a_litellm_router_alternating_two_vllm_servers_gets_each_switch_as_a_cache_hit(tmp_path, store):
    """The exactly related pair behind two vLLM OpenAI servers (`kvhandoff-lab bench-vllm`'s launcher), a LiteLLM
    Router with one deployment per server, unmodified: a conversation that moves small → large → small. The large
    server's first turn loads the small one's K/V mapped (usage's cached tokens say so) and answers as its own run."""
    os.environ["LITELLM_LOCAL_MODEL_COST_MAP"] = "True"
    import litellm
    import openai

    from kvhandoff.serving.chat import DEFAULT_CHAT_TEMPLATE
    from kvhandoff_lab.vllm_bench import vllm_servers

    small_path, large_path, mappers = _family(tmp_path)
    template = tmp_path / "chat.jinja"
    template.write_text(DEFAULT_CHAT_TEMPLATE)
    folders = {"small": small_path, "large": large_path}
    history = ("Tell me about the old lighthouse keeper who lived by the sea and kept a logbook of every ship "
               "that passed, every storm that came, and every light he saw on the water at night. ") * 3
    with vllm_servers(folders, {"store_url": store, "mappers": mappers}, tmp_path, max_model_len=1024,
                      dtype="float32", extra=("--chat-template", str(template))) as servers:
        router = litellm.Router(model_list=[
            {"model_name": f"coder-{name}", "litellm_params": {"model": f"hosted_vllm/{name}",
                                                               "api_base": server.url + "/v1", "api_key": "x"}}
            for name, server in servers.items()], num_retries=0)
        messages = [{"role": "user", "content": history}]
        cached = []
        for model, question in (("small", None), ("large", "And then?"), ("small", "Why?")):
            if question:
                messages.append({"role": "user", "content": question})
            response = router.completion(model=f"coder-{model}", messages=messages, max_tokens=8, temperature=0)
            details = response.usage.prompt_tokens_details
            cached.append(details.cached_tokens if details else None)
            if model == "large":
                own = openai.OpenAI(base_url=servers["large"].url + "/v1", api_key="x").chat.completions.create(
                    model="large", messages=messages, max_tokens=8, temperature=0, extra_body={"cache_salt": "own"})
                assert response.choices[0].message.content == own.choices[0].message.content
                assert own.usage.prompt_tokens_details.cached_tokens == 0
            messages.append({"role": "assistant", "content": response.choices[0].message.content})
        assert cached[0] == 0 and cached[1] >= 256 and cached[2] >= 256, cached
        assert "K/V of 'small' mapped to 'large'" in servers["large"].log_text()
