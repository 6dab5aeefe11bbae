"""Fill a store with K/V computed by transformers (not vLLM) for P1's and P2's full-block prefixes: the path a
kvhandoff mapper's output would take into vLLM."""
import json
import os
import sys

import safetensors.torch
import torch
from probe_connector import prefix_key
from run_probe import MODEL, P1, P2
from transformers import AutoModelForCausalLM

store = sys.argv[1]
model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32).eval()
for p, n in ((P1, 256), (P2, 128)):
    d = os.path.join(store, prefix_key(p[:n]))
    os.makedirs(d, exist_ok=True)
    with torch.no_grad():
        pkv = model(torch.tensor([p[:n]]), use_cache=True).past_key_values
    for i, layer in enumerate(pkv.layers):
        safetensors.torch.save_file({"k": layer.keys[0].transpose(0, 1).contiguous(),
                                     "v": layer.values[0].transpose(0, 1).contiguous()},
                                    os.path.join(d, f"model.layers.{i}.self_attn.attn.safetensors"))
    json.dump({"tokens": n, "layers": len(pkv.layers), "source": "transformers"}, open(os.path.join(d, "done"), "w"))
print("ok")
