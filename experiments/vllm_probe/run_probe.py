"""Drive the probe connector: one engine per process (phase), results to results/<phase>.json.

phases: baseline (no connector) | save (connector, empty store: saves) | load (fresh engine, same store: loads)
        | corrupt (fresh engine, loads zeros under the same keys)
"""
import argparse
import json
import os
import time
from pathlib import Path

MODEL = str(Path(__file__).resolve().parent / "tiny-qwen2")
P1 = [(7 * i + 3) % 256 for i in range(300)]           # 2 full blocks of 128 + 44
P2 = [(11 * i + 5) % 256 for i in range(200)]          # 1 full block + 72
P3 = P1[:256] + [(5 * i + 9) % 256 for i in range(40)]  # P1's 2-block prefix, another suffix
PROMPTS = {"save": [P1, P2], "baseline": [P1, P2, P3], "load": [P1, P2, P3], "corrupt": [P1, P2, P3]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("phase", choices=list(PROMPTS))
    ap.add_argument("--store", default=str(Path(__file__).resolve().parent / "kvstore"))
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--tokens", type=int, default=24)
    args = ap.parse_args()
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    kw = {}
    if args.phase != "baseline":
        kw["kv_transfer_config"] = KVTransferConfig(
            kv_connector="ProbeConnector", kv_connector_module_path="probe_connector", kv_role="kv_both",
            kv_connector_extra_config={"storage": args.store, "corrupt": "zeros" if args.phase == "corrupt" else ""})
    t0 = time.perf_counter()
    llm = LLM(model=MODEL, dtype=args.dtype, enforce_eager=True, max_model_len=1024, max_num_seqs=4, seed=0, **kw)
    load_s = time.perf_counter() - t0
    sp = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True, detokenize=False, logprobs=1)
    out = []
    for p in PROMPTS[args.phase]:  # one at a time: the save of P1 is complete before P3 could look it up
        t0 = time.perf_counter()
        r = llm.generate([TokensPrompt(prompt_token_ids=p)], sp, use_tqdm=False)[0]
        o = r.outputs[0]
        out.append({"prompt_len": len(p), "tokens": list(o.token_ids),
                    "logprobs": [lp[t].logprob for lp, t in zip(o.logprobs, o.token_ids, strict=False)],
                    "num_cached_tokens": r.num_cached_tokens, "s": round(time.perf_counter() - t0, 3)})
    res = os.environ.get("RESULTS", "results")
    os.makedirs(res, exist_ok=True)
    with open(f"{res}/{args.phase}.json", "w") as f:
        json.dump({"phase": args.phase, "load_s": round(load_s, 2), "out": out}, f)
    print("PHASE", args.phase, json.dumps([{k: v for k, v in o.items() if k != "logprobs"} for o in out]))


if __name__ == "__main__":
    main()
