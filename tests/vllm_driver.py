"""One vLLM engine with the kvhandoff connector, driven over stdin/stdout (run with .venv-vllm's python by
tests/test_vllm_connector.py): each stdin line is a JSON command, each answer one stdout line starting with
``KVH-REPLY `` (vLLM's and the connector's logs go to the same output).

Commands: {"op": "generate", "prompt": [ids], "tenant": str, "max_tokens": n} -> tokens, logprobs, cached tokens;
{"op": "keys", "pattern": glob} -> store keys; {"op": "copy", "src": key, "dst": key, "tenant": str | null,
"damage": null | "flip" | "truncate"} (a copy of an entry, its header's tenant rewritten when given, then damaged);
{"op": "quit"}.
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def reply(**fields) -> None:
    print("KVH-REPLY " + json.dumps(fields), flush=True)


def store_copy(store, command) -> dict:
    from kvhandoff.vllm.store import Expected, decode_entry, decode_header, encode_entry, entry_key, parse_key

    value = store.get(command["src"])
    header, _ = decode_header(value)
    tenant = command.get("tenant")
    if tenant is not None:  # a well-formed entry of the same rows for another tenant
        _, identity, prefix = parse_key(command["src"])
        rows = decode_entry(value, Expected(identity, header["tenant"], prefix, header["tokens"]))
        value = encode_entry(rows, identity=identity, model_name=header["model_name"], tenant=tenant, prefix=prefix)
        assert command["dst"] == entry_key(tenant, identity, prefix)
    damage = command.get("damage")
    if damage == "flip":
        value = value[:-7] + bytes([value[-7] ^ 0x40]) + value[-6:]
    elif damage == "truncate":
        value = value[:-100]
    store.put(command["dst"], value)
    return {"bytes": len(value)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--name", required=True)
    ap.add_argument("--store-url", required=True)
    ap.add_argument("--mappers", default="{}", help="JSON {'SOURCE->TARGET': folder}")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--recompute", default=None, help="the switches' recompute policy, e.g. recent:25%%")
    ap.add_argument("--models", default="{}", help="JSON {name: folder}: the load step's model copies")
    args = ap.parse_args()

    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    from kvhandoff.vllm.store import KVStore

    extra = {"store_url": args.store_url, "model": args.name, "mappers": json.loads(args.mappers),
             "recompute": args.recompute, "models": json.loads(args.models)}
    config = KVTransferConfig(kv_connector="KVHandoffConnector", kv_connector_module_path="kvhandoff.vllm.connector",
                              kv_role="kv_both", kv_load_failure_policy="recompute", kv_connector_extra_config=extra)
    started = time.perf_counter()
    llm = LLM(model=args.model, dtype=args.dtype, enforce_eager=True, max_model_len=1024, max_num_seqs=4, seed=0,
              kv_transfer_config=config)
    store = KVStore(args.store_url)
    reply(ready=True, start_s=round(time.perf_counter() - started, 1))
    for line in sys.stdin:
        command = json.loads(line)
        op = command["op"]
        try:
            if op == "quit":
                break
            if op == "generate":
                transfer = command.get("kv_transfer_params")
                params = SamplingParams(temperature=0.0, max_tokens=command.get("max_tokens", 16), ignore_eos=True,
                                        detokenize=False, logprobs=1,
                                        extra_args={"kv_transfer_params": transfer} if transfer else None)
                prompt = TokensPrompt(prompt_token_ids=command["prompt"], cache_salt=command["tenant"])
                out = llm.generate([prompt], params, use_tqdm=False)[0]
                sample = out.outputs[0]
                reply(tokens=list(sample.token_ids), cached=out.num_cached_tokens,
                      logprobs=[lp[t].logprob for lp, t in zip(sample.logprobs, sample.token_ids, strict=True)])
            elif op == "keys":
                reply(keys=store.keys(command.get("pattern", "kvhandoff:*")))
            elif op == "copy":
                reply(**store_copy(store, command))
            else:
                reply(error=f"unknown op {op!r}")
        except Exception as error:  # the test reads the error
            reply(error=f"{type(error).__name__}: {error}")


if __name__ == "__main__":
    main()
