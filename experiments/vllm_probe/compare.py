import json
import os

r = {p: json.load(open(f"{os.environ.get('RESULTS', 'results')}/{p}.json")) for p in ("baseline", "save", "load", "corrupt")}
base = r["baseline"]["out"]
for phase in ("save", "load", "corrupt"):
    for i, o in enumerate(r[phase]["out"]):
        b = base[i]
        same = o["tokens"] == b["tokens"]
        maxd = max(abs(x - y) for x, y in zip(o["logprobs"], b["logprobs"], strict=False)) if same else None
        first = next((j for j, (x, y) in enumerate(zip(o["tokens"], b["tokens"], strict=False)) if x != y), None)
        print(f"{phase:8s} P{i + 1} len {o['prompt_len']}: tokens equal baseline: {same}"
              f"{'' if same else f' (first diff at {first})'}; max |dlogprob| {maxd}; num_cached_tokens {o['num_cached_tokens']}")
events = [json.loads(x) for x in open(os.environ.get("STORE", "kvstore") + "/events.jsonl")]
print("events:", {e: sum(1 for x in events if x["event"] == e) for e in sorted({x["event"] for x in events})})
for x in events:
    if x["event"] in ("save_kv_layer", "start_load_kv") or (x["event"] == "get_num_new_matched_tokens" and x["returned"]):
        print(json.dumps(x))
