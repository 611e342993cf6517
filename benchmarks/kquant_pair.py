"""GGUF files of one random Llama model in Q4_1, Q4_K_M, IQ4_XS, IQ4_NL, Q3_K_M, Q2_K, IQ3_M, F16 and BF16 (and
in random blocks of IQ3_XXS and IQ2_XS), to time the K-quant and i-quant kernels against the legacy formats'.

    python -m benchmarks.kquant_pair OUT_DIR
    speculant bench model --model OUT_DIR/random-q4_1.gguf --long-context 0
    speculant bench model --model OUT_DIR/random-q4_k_m.gguf --long-context 0
    speculant bench model --model OUT_DIR/random-iq4_xs.gguf --long-context 0   (and iq4_nl, q3_k_m, q2_k, iq3_m,
                                                                               f16, bf16, blocks-iq3_xxs, blocks-iq2_xs)

SmolLM2's width (576) is not a multiple of 256, so llama.cpp cannot store it in K-quants or i-quants. This
model is the same size class with K-quant-friendly widths (hidden 768, FFN 2048, 12 layers,
12 heads / 4 KV heads, SmolLM2's tokenizer and vocabulary): random float16 weights, quantized by
llama.cpp's own quantizer (llama-cpp-python, `benchmarks/install_peers.sh`).
"""

from __future__ import annotations

import pathlib
import sys

import gguf
import numpy as np

SHAPE = dict(layers=12, hidden=768, inter=2048, heads=12, kv_heads=4)
FTYPES = {"q4_1": "LLAMA_FTYPE_MOSTLY_Q4_1", "q4_k_m": "LLAMA_FTYPE_MOSTLY_Q4_K_M",
          "iq4_xs": "LLAMA_FTYPE_MOSTLY_IQ4_XS", "iq4_nl": "LLAMA_FTYPE_MOSTLY_IQ4_NL",
          "q3_k_m": "LLAMA_FTYPE_MOSTLY_Q3_K_M", "q2_k": "LLAMA_FTYPE_MOSTLY_Q2_K",
          "iq3_m": "LLAMA_FTYPE_MOSTLY_IQ3_M", "bf16": "LLAMA_FTYPE_MOSTLY_BF16"}
# types llama.cpp quantizes only with an importance matrix: files of random blocks (random-blocks-TYPE.gguf)
RANDOM_BLOCKS = (gguf.GGMLQuantizationType.IQ3_XXS, gguf.GGMLQuantizationType.IQ2_XS)


def _copy_tokenizer(reader: gguf.GGUFReader, writer: gguf.GGUFWriter) -> int:
    for name, field in reader.fields.items():
        if name.startswith("tokenizer."):
            sub = field.types[1] if len(field.types) > 1 else None
            writer.add_key_value(name, field.contents(), field.types[0], sub)
    return len(reader.fields["tokenizer.ggml.tokens"].contents())


def _random_blocks(rng, rows: int, cols: int, qtype) -> np.ndarray:
    """rows x cols weights as random but valid blocks of `qtype` (random grid indices, signs and scales; the fp16
    d at byte 0 set to 1 / (64 sqrt(cols))): what the timings need of a type llama.cpp quantizes only with an
    importance matrix."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    blocks[:, :, :2] = np.full((rows, cols // block, 1), 1 / (64 * np.sqrt(cols)), np.float16).view(np.uint8)
    return blocks.reshape(rows, -1)


def write_f16(path: pathlib.Path, tokenizer_from: pathlib.Path, seed: int = 0, blocks_of=None) -> None:
    """The random model in float16, or with every matrix in random blocks of the type `blocks_of`."""
    rng = np.random.default_rng(seed)
    h, i, nh, nkv = SHAPE["hidden"], SHAPE["inter"], SHAPE["heads"], SHAPE["kv_heads"]
    hd = h // nh
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("random-llama-kquant")
    vocab = _copy_tokenizer(gguf.GGUFReader(tokenizer_from), writer)
    writer.add_block_count(SHAPE["layers"])
    writer.add_embedding_length(h)
    writer.add_feed_forward_length(i)
    writer.add_head_count(nh)
    writer.add_head_count_kv(nkv)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_context_length(4096)
    writer.add_vocab_size(vocab)
    file_type = "MOSTLY_F16" if blocks_of is None else f"MOSTLY_{blocks_of.name}"
    writer.add_file_type(gguf.LlamaFileType[file_type])

    def add(name, rows, cols):
        if blocks_of is not None:
            writer.add_tensor(name, _random_blocks(rng, rows, cols, blocks_of), raw_dtype=blocks_of)
        else:
            writer.add_tensor(name, (rng.standard_normal((rows, cols), np.float32) / np.sqrt(cols)).astype(np.float16))

    add("token_embd.weight", vocab, h)
    writer.add_tensor("output_norm.weight", np.ones(h, np.float32))
    for b in range(SHAPE["layers"]):
        p = f"blk.{b}."
        for name, shape in (("attn_q", (nh * hd, h)), ("attn_k", (nkv * hd, h)), ("attn_v", (nkv * hd, h)),
                            ("attn_output", (h, nh * hd)), ("ffn_gate", (i, h)), ("ffn_up", (i, h)),
                            ("ffn_down", (h, i))):
            add(p + name + ".weight", *shape)
        writer.add_tensor(p + "attn_norm.weight", np.ones(h, np.float32))
        writer.add_tensor(p + "ffn_norm.weight", np.ones(h, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def quantize(src: pathlib.Path, dst: pathlib.Path, ftype: str) -> None:
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, ftype)
    if llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), params) != 0:
        raise RuntimeError(f"llama.cpp could not quantize {src} to {ftype}")


def main(argv: list[str]) -> int:
    from engine.model.model_files import resolve_model

    out = pathlib.Path(argv[0] if argv else "kquant-pair")
    out.mkdir(parents=True, exist_ok=True)
    f16 = out / "random-f16.gguf"
    write_f16(f16, resolve_model("smollm2-135m"))
    for name, ftype in FTYPES.items():
        quantize(f16, out / f"random-{name}.gguf", ftype)
        print(f"wrote {out / f'random-{name}.gguf'}")
    for qtype in RANDOM_BLOCKS:
        path = out / f"random-blocks-{qtype.name.lower()}.gguf"
        write_f16(path, resolve_model("smollm2-135m"), blocks_of=qtype)
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
