"""A random mixture-of-experts GGUF with Qwen3-30B-A3B's layer shape, to time the MoE path beside llama.cpp.

    python -m benchmarks.moe_synthetic OUT_DIR [LAYERS]
    speculant bench model --model OUT_DIR/random-moe-q4_k_m.gguf --long-context 0 --peers

Each layer is Qwen3-30B-A3B's (hidden 2048; 32 query heads and 4 KV heads of 128 with q/k norms; 128
experts of width 768, each token's top 8), with SmolLM2's tokenizer and vocabulary; 2 layers by default
instead of 48 (a 2.4 GB float16 file before quantization). Random float16 weights, quantized to Q4_K_M by
llama.cpp's own quantizer (llama-cpp-python, `benchmarks/install_peers.sh`). Random routers spread the
tokens over the experts about evenly; real ones are less even, which favours the batched steps.
"""

from __future__ import annotations

import pathlib
import sys

import gguf
import numpy as np

from benchmarks.kquant_pair import _copy_tokenizer, quantize

SHAPE = dict(hidden=2048, heads=32, kv_heads=4, head_dim=128, experts=128, used=8, expert_ff=768)


def write_f16(path: pathlib.Path, tokenizer_from: pathlib.Path, layers: int, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    h, nh, nkv, hd = SHAPE["hidden"], SHAPE["heads"], SHAPE["kv_heads"], SHAPE["head_dim"]
    e, ff = SHAPE["experts"], SHAPE["expert_ff"]
    writer = gguf.GGUFWriter(str(path), "qwen3moe")
    writer.add_name("random-qwen3moe")
    vocab = _copy_tokenizer(gguf.GGUFReader(tokenizer_from), writer)
    for add, value in ((writer.add_block_count, layers), (writer.add_embedding_length, h),
                       (writer.add_feed_forward_length, 6144), (writer.add_head_count, nh),
                       (writer.add_head_count_kv, nkv), (writer.add_key_length, hd), (writer.add_value_length, hd),
                       (writer.add_rope_freq_base, 1e6), (writer.add_layer_norm_rms_eps, 1e-6),
                       (writer.add_context_length, 4096), (writer.add_expert_count, e),
                       (writer.add_expert_used_count, SHAPE["used"]), (writer.add_expert_feed_forward_length, ff)):
        add(value)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)

    def mat(*shape):
        return (rng.standard_normal(shape, np.float32) / np.sqrt(shape[-1])).astype(np.float16)

    writer.add_tensor("token_embd.weight", mat(vocab, h))
    writer.add_tensor("output.weight", mat(vocab, h))
    writer.add_tensor("output_norm.weight", np.ones(h, np.float32))
    for b in range(layers):
        p = f"blk.{b}."
        for name, shape in (("attn_q", (nh * hd, h)), ("attn_k", (nkv * hd, h)), ("attn_v", (nkv * hd, h)),
                            ("attn_output", (h, nh * hd)), ("ffn_gate_exps", (e, ff, h)), ("ffn_up_exps", (e, ff, h)),
                            ("ffn_down_exps", (e, h, ff))):
            writer.add_tensor(p + name + ".weight", mat(*shape))
        writer.add_tensor(p + "ffn_gate_inp.weight", (rng.standard_normal((e, h), np.float32) / np.sqrt(h)).astype(np.float32))
        for name, size in (("attn_norm", h), ("ffn_norm", h), ("attn_q_norm", hd), ("attn_k_norm", hd)):
            writer.add_tensor(p + name + ".weight", np.ones(size, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def main(argv: list[str]) -> int:
    from engine.model.model_files import resolve_model

    out = pathlib.Path(argv[0] if argv else "moe-synthetic")
    layers = int(argv[1]) if len(argv) > 1 else 2
    out.mkdir(parents=True, exist_ok=True)
    f16 = out / "random-moe-f16.gguf"
    write_f16(f16, resolve_model("smollm2-135m"), layers)
    dst = out / "random-moe-q4_k_m.gguf"
    quantize(f16, dst, "LLAMA_FTYPE_MOSTLY_Q4_K_M")
    f16.unlink()
    print(f"wrote {dst}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
