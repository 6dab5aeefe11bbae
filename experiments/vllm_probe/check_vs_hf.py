"""The connector's saved K/V (decoded from vLLM's paged cache) vs transformers' past_key_values for the same tokens."""
import safetensors.torch
import torch
from probe_connector import prefix_key
from run_probe import MODEL, P1, P2
from transformers import AutoModelForCausalLM

model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32).eval()
for name, p, n in (("P1", P1, 256), ("P2", P2, 128)):
    with torch.no_grad():
        pkv = model(torch.tensor([p[:n]]), use_cache=True).past_key_values
    for i in range(2):
        s = safetensors.torch.load_file(f"kvstore/{prefix_key(p[:n])}/model.layers.{i}.self_attn.attn.safetensors")
        hk = pkv.layers[i].keys[0].transpose(0, 1)   # [T, h, hd]
        hv = pkv.layers[i].values[0].transpose(0, 1)
        print(name, "layer", i, "saved", tuple(s["k"].shape), s["k"].dtype,
              "max|K-K_hf| {:.2e} max|V-V_hf| {:.2e}".format((s["k"] - hk).abs().max(), (s["v"] - hv).abs().max()),
              f"|K_hf| max {hk.abs().max():.2f}")
