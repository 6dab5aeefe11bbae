"""Save a tiny random Qwen2 (2 layers, hidden 64, 2 q heads, 2 KV heads, head_dim 32, vocab 300) with the
project's chat tokenizer to ./tiny-qwen2 (vLLM's CPU attention supports head sizes 32, 64, ...; not 16; and vLLM's Qwen2 takes head_dim = hidden_size // num_attention_heads, ignoring config.head_dim)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
from conftest import chat_tokenizer, tiny_model

model = tiny_model("qwen2", layers=2, head_dim=32, kv_heads=2, heads=2, vocab_size=300, attn_implementation=None)
tok = chat_tokenizer()
model.config.eos_token_id = tok.eos_token_id
model.config.bos_token_id = None
model.generation_config.eos_token_id = tok.eos_token_id
model.save_pretrained("tiny-qwen2")
tok.save_pretrained("tiny-qwen2")
print(model.config)
print("eos", tok.eos_token_id, "vocab", len(tok))
