"""Step 2: greedy generation of the tiny random Qwen2 through vllm.LLM vs transformers, token for token."""
import argparse
import json
import time
from pathlib import Path

MODEL = str(Path(__file__).resolve().parent / "tiny-qwen2")
PROMPTS = [
    [(7 * i + 3) % 256 for i in range(40)],
    [(11 * i + 5) % 256 for i in range(77)],
    [(13 * i + 1) % 256 for i in range(130)],
]


def hf_greedy(dtype, n):
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=dtype).eval()
    outs = []
    with torch.no_grad():
        for p in PROMPTS:
            ids = torch.tensor([p])
            out = model.generate(ids, max_new_tokens=n, do_sample=False, min_new_tokens=n, pad_token_id=0,
                                 eos_token_id=None)
            outs.append(out[0, len(p):].tolist())
    return outs


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--tokens", type=int, default=32)
    args = ap.parse_args()
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    t0 = time.perf_counter()
    llm = LLM(model=MODEL, dtype=args.dtype, enforce_eager=True, max_model_len=1024, max_num_seqs=4,
              seed=0)
    load_s = time.perf_counter() - t0
    sp = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True, detokenize=False)
    llm.generate([TokensPrompt(prompt_token_ids=PROMPTS[0])], sp, use_tqdm=False)  # warm up
    t0 = time.perf_counter()
    res = llm.generate([TokensPrompt(prompt_token_ids=p) for p in PROMPTS], sp, use_tqdm=False)
    gen_s = time.perf_counter() - t0
    vl = [list(r.outputs[0].token_ids) for r in res]
    # one sequence alone, for single-stream tokens/s
    t0 = time.perf_counter()
    llm.generate([TokensPrompt(prompt_token_ids=PROMPTS[1])], sp, use_tqdm=False)
    one_s = time.perf_counter() - t0
    import torch
    hf = hf_greedy(getattr(torch, args.dtype), args.tokens)
    # teacher-forced check: HF's full forward over prompt + vLLM's tokens; each vLLM token must be HF's argmax
    # (or within 1e-3 nats of it: a near tie that HF's own incremental decode can break either way)
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=getattr(torch, args.dtype)).eval()
    tf = []
    with torch.no_grad():
        for p, toks in zip(PROMPTS, vl, strict=False):
            lp = torch.log_softmax(model(torch.tensor([p + toks])).logits[0].float(), -1)[len(p) - 1:-1]
            gap = lp.max(-1).values - lp[torch.arange(len(toks)), torch.tensor(toks)]
            tf.append({"argmax_agree": int((gap == 0).sum()), "of": len(toks), "max_gap": round(gap.max().item(), 5)})
    report = {"teacher_forced": tf, "dtype": args.dtype, "load_s": round(load_s, 2), "batch3_s": round(gen_s, 3),
              "batch3_tok_per_s": round(3 * args.tokens / gen_s, 1), "single_s": round(one_s, 3),
              "single_tok_per_s": round(args.tokens / one_s, 1),
              "match": [a == b for a, b in zip(vl, hf, strict=False)],
              "first_diff": [next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None) for a, b in zip(vl, hf, strict=False)],
              "vllm": vl, "hf": hf}
    print("REPORT", json.dumps(report))


if __name__ == "__main__":
    main()
