"""The other systems `speculant bench peers` runs: llama.cpp and Hugging Face transformers.

Each peer loads the same GGUF file, takes every prompt as the same text (already rendered with
our chat template) and decodes greedily in two modes: plain, and with its own prompt-lookup
decoding. Per prompt it reports a `PromptRun`: the output (token ids, or text where the library
hands back no ids), how many tokens it generated, the wall time, and when the first token came.
A peer whose package is missing is never imported past `missing()`; `speculant[peers]` installs
them all.
"""

from __future__ import annotations

import importlib
import os
import pathlib
import time
from dataclasses import dataclass

NOT_INSTALLED = "not installed (pip install 'speculant[peers]')"
LOOKUP_TOKENS = 10  # both libraries' documented default number of prompt-lookup draft tokens


@dataclass
class PromptRun:
    prompt_id: str
    output: list[int] | str  # token ids, or the text (llama.cpp's completion API returns no ids)
    num_tokens: int  # generated tokens, a final end-of-sequence token included
    wall_s: float
    first_s: float | None  # from the call to the first generated token


@dataclass(frozen=True)
class PeerOptions:
    model_path: pathlib.Path
    threads: int  # 0 = every core
    max_model_len: int
    num_lookup_tokens: int  # K of the prompt-lookup mode

    @property
    def num_threads(self) -> int:
        return self.threads or os.cpu_count() or 1


class Peer:
    """One library: `load()` once, then `generate(mode, text, max_tokens)` for each mode in `modes()`."""

    name = ""
    modules: tuple[str, ...] = ()
    compared_by = "token ids"  # what `PromptRun.output` holds, for the losslessness column

    def missing(self) -> str | None:
        """NOT_INSTALLED when one of the packages cannot be imported."""
        for module in self.modules:
            try:
                importlib.import_module(module)
            except ImportError:
                return NOT_INSTALLED
        return None

    def modes(self, opts: PeerOptions) -> list[str]:
        return ["plain", f"prompt lookup K={opts.num_lookup_tokens}"]


# ---------------------------------------------------------------- llama.cpp (llama-cpp-python)


class _TokenClock:
    """A llama.cpp stopping criterion that never stops: it notes when the first token was sampled
    and counts the sampled tokens (the end-of-generation token included)."""

    def __init__(self):
        self.first: float | None = None
        self.count = 0

    def __call__(self, input_ids, logits) -> bool:
        self.count += 1
        if self.first is None:
            self.first = time.perf_counter()
        return False


class LlamaCppPeer(Peer):
    name = "llama.cpp"
    modules = ("llama_cpp", "llama_cpp.llama_speculative")
    compared_by = "text"

    def load(self, opts: PeerOptions) -> None:
        import llama_cpp
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        common = {"model_path": str(opts.model_path), "n_ctx": opts.max_model_len, "n_threads": opts.num_threads,
                  "n_threads_batch": opts.num_threads, "seed": 0, "verbose": False}
        self.version = llama_cpp.__version__
        plain, lookup = self.modes(opts)
        # NOTE: with a draft model, llama-cpp-python 0.3.x keeps every row's logits but sizes that buffer
        # n_batch rows unless logits_all=True is passed: a longer prompt + output overflows it.
        draft = LlamaPromptLookupDecoding(num_pred_tokens=opts.num_lookup_tokens)
        self.models = {plain: llama_cpp.Llama(**common),
                       lookup: llama_cpp.Llama(**common, draft_model=draft, logits_all=True)}

    def prompt_ids(self, text: str) -> list[int]:
        model = next(iter(self.models.values()))
        ids = model.tokenize(text.encode("utf-8"), add_bos=True, special=True)
        if len(ids) > 1 and ids[0] == ids[1] == model.token_bos():  # the chat template wrote <bos> already
            ids = ids[1:]
        return ids

    def generate(self, mode: str, prompt_id: str, text: str, max_tokens: int) -> PromptRun:
        from llama_cpp import StoppingCriteriaList

        clock = _TokenClock()
        start = time.perf_counter()
        out = self.models[mode].create_completion(
            self.prompt_ids(text), max_tokens=max_tokens, temperature=0.0, repeat_penalty=1.0,
            stopping_criteria=StoppingCriteriaList([clock]))
        wall = time.perf_counter() - start
        first = clock.first - start if clock.first is not None else None
        # the clock also counts a sample taken past max_tokens; an end-of-generation token counts, as elsewhere
        return PromptRun(prompt_id, out["choices"][0]["text"], min(clock.count, max_tokens), wall, first)


# ---------------------------------------------------------------- Hugging Face transformers


def _first_token_streamer():
    """A transformers streamer noting when generate() hands over its first generated tokens
    (its first put() carries the prompt)."""
    from transformers.generation.streamers import BaseStreamer

    class FirstTokenStreamer(BaseStreamer):
        def __init__(self):
            self.num_puts = 0
            self.first: float | None = None

        def put(self, value) -> None:
            self.num_puts += 1
            if self.num_puts == 2:
                self.first = time.perf_counter()

        def end(self) -> None:
            pass

    return FirstTokenStreamer()


class TransformersPeer(Peer):
    name = "transformers"
    modules = ("torch", "transformers")

    def load(self, opts: PeerOptions) -> None:
        import torch
        import transformers
        from packaging.version import Version
        from transformers import AutoModelForCausalLM, AutoTokenizer

        transformers.utils.logging.disable_progress_bar()
        torch.set_num_threads(opts.num_threads)
        path = opts.model_path
        self.version = transformers.__version__
        self.tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        # fp32 on the CPU: the GGUF's weights are dequantized once at load (`torch_dtype` before 4.56)
        dtype_key = "dtype" if Version(transformers.__version__) >= Version("4.56") else "torch_dtype"
        self.model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                          **{dtype_key: torch.float32}).eval()
        plain, lookup = self.modes(opts)
        self.extra = {plain: {}, lookup: {"prompt_lookup_num_tokens": opts.num_lookup_tokens}}

    def prompt_ids(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False).input_ids

    def generate(self, mode: str, prompt_id: str, text: str, max_tokens: int) -> PromptRun:
        import torch

        ids = torch.tensor([self.prompt_ids(text)])  # [1, num_prompt_tokens]
        streamer = _first_token_streamer()
        start = time.perf_counter()
        with torch.inference_mode():
            out = self.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                                      do_sample=False, pad_token_id=self.tokenizer.eos_token_id,
                                      streamer=streamer, **self.extra[mode])
        wall = time.perf_counter() - start
        new_ids = out[0, ids.shape[1]:].tolist()
        first = streamer.first - start if streamer.first is not None else None
        return PromptRun(prompt_id, new_ids, len(new_ids), wall, first)


PEERS = {peer.name: peer for peer in (LlamaCppPeer, TransformersPeer)}
