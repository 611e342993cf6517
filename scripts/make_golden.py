"""Regenerate the reference fixtures in tests/fixtures/ from Hugging Face transformers.

Needs torch (CPU) + transformers + regex, which the project and its tests do not:

    python3 -m venv /tmp/refvenv
    /tmp/refvenv/bin/pip install torch transformers gguf numpy tokenizers regex
    PYTHONPATH=. /tmp/refvenv/bin/python scripts/make_golden.py [--model PATH]

Writes
  tests/fixtures/tokenizer_golden.json  token ids, decodes and chat renders (reference tokenizer)
  tests/fixtures/logits_golden.npz      float32 logits of 3 prompts (transformers, dequantized GGUF)

logits_golden.npz: the GGUF is loaded by transformers with every weight dequantized to a dense
float32 model (GgufConfig(dequantize=True)), and each prompt (`prompt_names`: prose, code, chat,
100+ tokens each) is run in one forward pass. Per prompt NAME:
  NAME_ids [T] int32 prompt token ids; NAME_argmax [T] int32 argmax of the logits at each position;
  NAME_top_ids / NAME_top_logits [T, 16] the 16 largest logits, best first;
  NAME_random_logits [T, 512] the logits of the fixed `random_ids` [512] (seed 0);
  NAME_logsumexp [T] over the full vocabulary.
Plus `versions` and `model_sha256`.

Reference tokenizer. transformers' GGUF loader ignores `tokenizer.ggml.pre = smollm` and falls
back to the plain GPT-2 split; SmolLM2's own tokenizer.json (and llama.cpp's `smollm`) first
split every \\p{N} character off, then apply the GPT-2 regex. They differ on whitespace before a
number (GPT-2 pre-splits "a  12" as "a", " ", " 12", so two single-space tokens; SmolLM2 as
"a  ", "1", "2", merging the spaces into "ĠĠ") and on numerals such as "½" (GPT-2 glues the
space on). So the golden ids come from llama.cpp's algorithm written out here with the `regex`
module, with BPE done by transformers' converted vocabulary; the result is cross-checked against
transformers' tokenizer fitted with SmolLM2's published pre-tokenizer. transformers' own GGUF ids
are stored too, with a flag where they differ.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import pathlib
import sys

import numpy as np
import regex
import tokenizers
import torch
import transformers
from tokenizers import Tokenizer as BackendTokenizer
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.convert_slow_tokenizer import bytes_to_unicode

ROOT = pathlib.Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures"

TEXTS = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    "for (int i = 0; i < 10; ++i) { sum += a[i] * b[i]; }\t// dot",
    "12345 and 3.14159 and 1,000,000 and -42e-3",
    "a  12\nx =    7\n\t\t99 bottles",
    "Café naïve résumé façade Ångström über Straße",
    "Emoji: 😀👍🏽🇺🇸 ❤️ and a family 👨‍👩‍👧",
    "中文测试：你好，世界！日本語のテキスト、한국어 텍스트",
    "Fractions ½ ¾, powers x² y³, roman Ⅻ, Arabic-Indic ٣٤٥",
    "  leading spaces, trailing spaces   \n\n\nthree newlines\r\nCRLF\n",
    "I'm sure they'll say it's fine, don't you think? We've seen it.",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>",
    "<|endoftext|>text after eot<repo_name>speculant<file_sep>main.py",
    "A literal <|im_start without closing and <|im_end|>x",
    "ctrl\x04char and \x7f del",
    "",
    " ",
    "\n",
    "https://example.com/path?query=1&b=2#frag user@example.org",
    'JSON: {"key": [1, 2.5, null, true], "nested": {"a": "b"}}',
    "Математика и русский язык; Ελληνικά; עברית; العربية",
]

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "Write a haiku about speculative decoding."},
        {"role": "assistant", "content": "Draft tokens fly,\nthe verifier nods or not,\nbonus token waits."},
        {"role": "user", "content": "Now one about 42 cats 🐱."},
    ],
]

PROSE = (
    "The history of the printing press is a story of slow diffusion followed by sudden change. "
    "When Johannes Gutenberg combined movable metal type, oil-based ink and a wooden screw press "
    "around 1450, he did not merely speed up the copying of books; he changed who could afford to "
    "read them. Within fifty years, presses operated in more than two hundred European cities, and "
    "millions of volumes had been printed. Scholars could now compare identical copies of a text, "
    "errors could be corrected in later editions, and ideas travelled faster than their authors. "
    "Historians still debate how much of the Reformation, the scientific revolution and the rise of "
    "literacy should be credited to this single invention."
)
CODE = (
    "import heapq\n\n\ndef dijkstra(graph, source):\n"
    '    """Shortest distances from source in a graph with non-negative edge weights."""\n'
    "    dist = {node: float('inf') for node in graph}\n    dist[source] = 0\n"
    "    queue = [(0, source)]\n    while queue:\n        d, node = heapq.heappop(queue)\n"
    "        if d > dist[node]:\n            continue\n"
    "        for neighbour, weight in graph[node].items():\n"
    "            candidate = d + weight\n            if candidate < dist[neighbour]:\n"
    "                dist[neighbour] = candidate\n                heapq.heappush(queue, (candidate, neighbour))\n"
    "    return dist\n"
)
CHAT = [
    {"role": "system", "content": "You are a helpful assistant who answers in complete sentences."},
    {"role": "user", "content": "What causes the seasons on Earth?"},
    {"role": "assistant", "content": "The seasons are caused by the tilt of Earth's axis, about 23.4 degrees, "
     "which changes how directly sunlight strikes each hemisphere as Earth orbits the Sun."},
    {"role": "user", "content": "Explain in a few sentences why the sky is blue, and why sunsets are red or "
     "orange. Mention Rayleigh scattering and the length of the path that sunlight takes through the air."},
]  # fmt: skip

NUM_TOP = 16
NUM_RANDOM = 512
GPT2_SPLIT = regex.compile(r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+")
NUMERAL = regex.compile(r"\p{N}")
# SmolLM2's tokenizer.json, as published (HuggingFaceTB/SmolLM2-135M-Instruct).
SMOLLM2_PRE_TOKENIZER = {
    "type": "Sequence",
    "pretokenizers": [
        {"type": "Digits", "individual_digits": True},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
    ],
}


def isolated_split(pattern: regex.Pattern, text: str) -> list[str]:
    """Matches and the text between them, in order (llama.cpp / `isolated` behaviour)."""
    pieces, pos = [], 0
    for match in pattern.finditer(text):
        pieces += [text[pos : match.start()], match.group()]
        pos = match.end()
    return [p for p in [*pieces, text[pos:]] if p]


class ReferenceTokenizer:
    """llama.cpp's `smollm` pre-tokenization + transformers' BPE vocabulary."""

    def __init__(self, hf_tokenizer):
        self.hf = hf_tokenizer
        self.model = hf_tokenizer.backend_tokenizer.model
        self.byte_to_char = bytes_to_unicode()
        added = hf_tokenizer.added_tokens_decoder.items()  # {id: AddedToken}
        self.special_ids = {token.content: token_id for token_id, token in sorted(added) if token.special}
        specials = sorted(self.special_ids, key=len, reverse=True)  # longest first: leftmost-longest match
        self.special_re = regex.compile("|".join(regex.escape(t) for t in specials))

    def encode(self, text: str) -> list[int]:
        ids = []
        for piece in isolated_split(self.special_re, text):
            if piece in self.special_ids:
                ids.append(self.special_ids[piece])
                continue
            for chunk in isolated_split(NUMERAL, piece):
                for word in GPT2_SPLIT.findall(chunk):
                    spelled = "".join(self.byte_to_char[b] for b in word.encode("utf-8"))
                    ids += [token.id for token in self.model.tokenize(spelled)]
        return ids


def published_pipeline(hf_tokenizer) -> BackendTokenizer:
    spec = json.loads(hf_tokenizer.backend_tokenizer.to_str())
    spec["pre_tokenizer"] = SMOLLM2_PRE_TOKENIZER
    return BackendTokenizer.from_str(json.dumps(spec))


def sha256(path: pathlib.Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def versions() -> dict[str, str]:
    return {"transformers": transformers.__version__, "torch": torch.__version__, "tokenizers": tokenizers.__version__}


def tokenizer_golden(model_path: pathlib.Path, hf_tok, reference: ReferenceTokenizer) -> dict:
    published = published_pipeline(hf_tok)
    texts = []
    for text in TEXTS:
        ids = reference.encode(text)
        published_ids = published.encode(text, add_special_tokens=False).ids
        if ids != published_ids:
            sys.exit(f"reference and SmolLM2's published pipeline disagree on {text!r}: {ids} vs {published_ids}")
        hf_ids = hf_tok.encode(text, add_special_tokens=False)
        decoded = hf_tok.decode(ids, skip_special_tokens=False)
        texts.append({
            "text": text, "ids": ids, "decoded": decoded, "roundtrip": decoded == text,
            "ids_transformers_gguf": hf_ids, "transformers_gguf_agrees": hf_ids == ids,
        })  # fmt: skip
    chats = []
    for messages in CONVERSATIONS:
        for add_generation_prompt in (True, False):
            rendered = hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
            chats.append({"messages": messages, "add_generation_prompt": add_generation_prompt, "rendered": rendered,
                          "ids": reference.encode(rendered)})  # fmt: skip
    return {
        "model_sha256": sha256(model_path),
        "versions": versions(),
        "note": __doc__.split("Reference tokenizer.")[1].strip(),
        "special_tokens": reference.special_ids,
        "bos_token_id": hf_tok.bos_token_id,
        "eos_token_id": hf_tok.eos_token_id,
        "texts": texts,
        "chats": chats,
    }


@torch.no_grad()
def logits_golden(model_path: pathlib.Path, hf_tok, reference: ReferenceTokenizer) -> dict[str, np.ndarray]:
    model = AutoModelForCausalLM.from_pretrained(
        str(model_path.parent), gguf_file=model_path.name, dtype=torch.float32,
        quantization_config=transformers.GgufConfig(dequantize=True),
    ).eval()  # fmt: skip
    dtypes = {p.dtype for p in model.parameters()}
    assert dtypes == {torch.float32}, f"expected a dense float32 model, got {dtypes}"
    rng = np.random.default_rng(0)
    random_ids = np.sort(rng.choice(model.config.vocab_size, NUM_RANDOM, replace=False)).astype(np.int32)
    prompts = {"prose": PROSE, "code": CODE, "chat": hf_tok.apply_chat_template(CHAT, tokenize=False,
                                                                             add_generation_prompt=True)}  # fmt: skip
    out: dict[str, np.ndarray] = {
        "random_ids": random_ids,
        "prompt_names": np.array(list(prompts)),
        "versions": np.array([f"{k}={v}" for k, v in versions().items()]),
        "model_sha256": np.array(sha256(model_path)),
    }
    for name, text in prompts.items():
        ids = reference.encode(text)
        assert len(ids) >= 100, (name, len(ids))
        logits = model(torch.tensor([ids])).logits[0].float().numpy()  # [num_tokens, vocab]
        top_ids = np.argsort(-logits, axis=1, kind="stable")[:, :NUM_TOP].astype(np.int32)  # [num_tokens, 16]
        out[f"{name}_ids"] = np.array(ids, dtype=np.int32)  # [num_tokens]
        out[f"{name}_argmax"] = logits.argmax(axis=1).astype(np.int32)  # [num_tokens]
        out[f"{name}_top_ids"] = top_ids
        out[f"{name}_top_logits"] = np.take_along_axis(logits, top_ids, axis=1)  # [num_tokens, 16]
        out[f"{name}_random_logits"] = logits[:, random_ids]  # [num_tokens, 512]
        out[f"{name}_logsumexp"] = torch.logsumexp(torch.from_numpy(logits), dim=1).numpy()  # [num_tokens]
        greedy = model.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False)[0, len(ids) :]
        print(f"{name}: {len(ids)} tokens; greedy continuation: {hf_tok.decode(greedy)!r}", file=sys.stderr)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="GGUF path (default: the cached smollm2-135m)")
    parser.add_argument("--skip-logits", action="store_true")
    args = parser.parse_args()
    if args.model is None:
        from engine.model.model_files import resolve_model

        args.model = resolve_model("smollm2-135m")
    model_path = pathlib.Path(args.model).resolve()
    hf_tok = AutoTokenizer.from_pretrained(str(model_path.parent), gguf_file=model_path.name)
    reference = ReferenceTokenizer(hf_tok)
    FIXTURES.mkdir(parents=True, exist_ok=True)
    golden = tokenizer_golden(model_path, hf_tok, reference)
    (FIXTURES / "tokenizer_golden.json").write_text(json.dumps(golden, ensure_ascii=False, indent=1) + "\n")
    differ = [t["text"] for t in golden["texts"] if not t["transformers_gguf_agrees"]]
    print(f"tokenizer: {len(golden['texts'])} texts; transformers' GGUF tokenizer differs on {differ}", file=sys.stderr)
    if not args.skip_logits:
        np.savez_compressed(FIXTURES / "logits_golden.npz", **logits_golden(model_path, hf_tok, reference))
    print(f"wrote {FIXTURES}", file=sys.stderr)


if __name__ == "__main__":
    main()
