"""Tiny GGUF models for the llama.cpp engine's tests: a tiny transformers Qwen2 model written as an f32 GGUF with the
`gguf` package's writer (the tensor names and metadata llama.cpp's own converter gives a Qwen2 model), and a
`LlamaCppModel` of it."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from kvhandoff.model.geometry import model_fingerprint


def write_gguf(model, path: Path) -> Path:
    """``model`` (a transformers Qwen2ForCausalLM) as an f32 GGUF at ``path``, with a placeholder vocabulary of its
    size (the tests feed token ids, never text)."""
    import gguf

    config = model.config
    arch = gguf.MODEL_ARCH.QWEN2
    writer = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[arch])
    writer.add_name("tiny-qwen2")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_rope_freq_base(float(config.rope_parameters["rope_theta"]))
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list([f"<t{i}>" for i in range(config.vocab_size)])
    writer.add_token_types([gguf.TokenType.NORMAL] * config.vocab_size)
    writer.add_token_merges(["< t"])
    writer.add_eos_token_id(config.vocab_size - 1)
    names = gguf.get_tensor_name_map(arch, config.num_hidden_layers)
    for name, tensor in model.state_dict().items():
        base, _, suffix = name.rpartition(".")
        mapped = names.get_name(base)
        if mapped is None:
            raise ValueError(f"no GGUF name for {name}")
        writer.add_tensor(f"{mapped}.{suffix}", tensor.detach().float().numpy().astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def llama_model(model, folder: Path, name: str = "tiny", generation_config=None, **settings):
    """A `LlamaCppModel` of ``model`` (written as a GGUF in ``folder``), fingerprinted as ``model``, with an f32
    cache unless settings say otherwise."""
    from kvhandoff.runtime.llama_cpp.backend import LlamaCppModel, LlamaCppSettings

    gguf_path = write_gguf(model, folder / f"{name}.gguf")
    options = {"cache_type": "f32", "context": 1024, "sequences": 8, "threads": 1, "batch": 64, **settings}
    return LlamaCppModel(gguf_path, model.config, model_fingerprint(model), LlamaCppSettings(**options), name=name,
                         generation_config=generation_config)
