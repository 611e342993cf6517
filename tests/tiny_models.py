"""Tiny random Llama GGUFs that carry the real SmolLM2 tokenizer, so the whole engine runs on them fast.

The weights are random (seeded); the vocabulary and chat template are copied from the default model,
so two tiny models share a vocabulary with each other and with the real target.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

from engine.model.gguf_metadata import read_gguf_metadata

_TOKENIZER_IDS = ("bos_token_id", "eos_token_id", "unknown_token_id", "padding_token_id")


def copy_tokenizer(writer: gguf.GGUFWriter, source: dict, rename: dict[int, str] | None = None) -> int:
    """Copy the tokenizer metadata of `source` (a GGUF's metadata, read_gguf_metadata) to the writer, with some
    tokens renamed to make a different vocabulary; returns its size."""
    writer.add_tokenizer_model(source["tokenizer.ggml.model"])
    writer.add_tokenizer_pre(source["tokenizer.ggml.pre"])
    writer.add_chat_template(source["tokenizer.chat_template"])
    tokens = list(source["tokenizer.ggml.tokens"])
    for i, text in (rename or {}).items():
        tokens[i] = text
    writer.add_token_list(tokens)
    writer.add_token_types(source["tokenizer.ggml.token_type"])
    writer.add_token_merges(source["tokenizer.ggml.merges"])
    for key in _TOKENIZER_IDS:
        writer.add_uint32(f"tokenizer.ggml.{key}", int(source[f"tokenizer.ggml.{key}"]))
    writer.add_bool("tokenizer.ggml.add_bos_token", bool(source["tokenizer.ggml.add_bos_token"]))
    return len(tokens)


def write_tiny_llama(path: Path, tokenizer_source: Path, seed: int = 0, layers: int = 2, hidden: int = 64,
                     heads: int = 4, kv_heads: int = 2, inter: int = 128, logit_scale: float = 1.0,
                     rename: dict[int, str] | None = None, weights: str = "F32", values_of: str | None = None) -> Path:
    """A random Llama GGUF (its own output matrix) with the source's tokenizer.

    `logit_scale` sharpens the output distribution (logits are scaled by it), so that a few dozen
    tokens carry most of the mass: statistical tests then need few samples. The matrices are stored
    as `weights` (F32, F16 or BF16; norms stay F32); `values_of` (F16 or BF16) rounds their values
    to that type first, so an F32 file can hold exactly the values of an F16 or BF16 one.
    """
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), "llama")
    vocab = copy_tokenizer(writer, read_gguf_metadata(tokenizer_source), rename)
    writer.add_name(f"tiny-llama-{seed}")
    writer.add_block_count(layers)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(inter)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_context_length(512)
    writer.add_vocab_size(vocab)
    hd = hidden // heads
    shapes = {"attn_q": (heads * hd, hidden), "attn_k": (kv_heads * hd, hidden), "attn_v": (kv_heads * hd, hidden),
              "attn_output": (hidden, heads * hd), "ffn_gate": (inter, hidden), "ffn_up": (inter, hidden),
              "ffn_down": (hidden, inter)}
    stored, rounded = gguf.GGMLQuantizationType[weights], values_of and gguf.GGMLQuantizationType[values_of]

    def add_matrix(name, values):
        values = values.astype(np.float32)
        if rounded:
            values = gguf.quants.dequantize(gguf.quants.quantize(values, rounded), rounded).reshape(values.shape)
        if stored == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(name, values)
        else:
            writer.add_tensor(name, gguf.quants.quantize(values, stored), raw_dtype=stored)

    add_matrix("token_embd.weight", rng.standard_normal((vocab, hidden)))
    writer.add_tensor("output_norm.weight", np.full(hidden, logit_scale, np.float32))
    add_matrix("output.weight", rng.standard_normal((vocab, hidden)))
    for i in range(layers):
        writer.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(hidden, np.float32))
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(hidden, np.float32))
        for name, shape in shapes.items():
            add_matrix(f"blk.{i}.{name}.weight", rng.standard_normal(shape) / np.sqrt(shape[1]))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(path)
