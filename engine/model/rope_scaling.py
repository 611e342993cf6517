"""YaRN RoPE scaling as a GGUF states it (`{arch}.rope.scaling.type = yarn`): Qwen 2.5 / 3 long-context
files, and any other file whose converter saw `rope_scaling: {"rope_type": "yarn", ...}`.

YaRN leaves RoPE's fast pairs alone, divides the slow pairs' frequencies by the scaling factor (position
interpolation), blends the pairs in between linearly, and scales cos and sin by a magnitude that
grows with log(factor). Both parts fit the two hooks every RoPE table here already has: per-frequency
divisors (as Llama 3's rope_freqs) and a cos/sin scale (as LongRoPE's attn_factor). The pair bounds
are whole numbers (floor / ceil), as llama.cpp's ggml_rope_yarn_corr_dims and transformers'
default `truncate` have them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, slots=True)
class Yarn:
    factor: float  # context extension: the slow pairs' frequencies are divided by it
    original_context: int  # the context the model was pretrained on
    beta_fast: float = 32.0  # pairs turning more often than this over the original context keep their frequency
    beta_slow: float = 1.0  # pairs turning less often than this are fully interpolated
    ext_factor: float = 1.0  # weight of the kept frequency in the blend (llama.cpp's yarn_ext_factor)
    attn_factor: float = 0.0  # the file's cos/sin scale (transformers' attention_factor); 0: from the factor
    log_multiplier: float = 0.0  # mscale_all_dim (DeepSeek-style magnitude); 0: none

    def __post_init__(self):
        if not self.factor > 0 or self.original_context <= 0:
            raise ValueError(f"YaRN needs rope.scaling.factor > 0 and original_context_length > 0, not "
                             f"{self.factor} and {self.original_context}")

    def _pair_turning(self, turns: float, rope_dim: int, base: float) -> float:
        """The (fractional) pair index whose wavelength fits `turns` times into the original context."""
        return rope_dim * math.log(self.original_context / (turns * 2 * math.pi)) / (2 * math.log(base))

    def divisors(self, rope_dim: int, base: float) -> np.ndarray:
        """[rope_dim / 2] float64 divisors of RoPE's frequencies: 1 for the pairs kept, `factor` for the
        interpolated ones, and 1 / (keep + (1 - keep) / factor) in between."""
        lo = max(0.0, math.floor(self._pair_turning(self.beta_fast, rope_dim, base)))
        hi = min(rope_dim - 1.0, math.ceil(self._pair_turning(self.beta_slow, rope_dim, base)))
        pair = np.arange(rope_dim // 2, dtype=np.float64)
        keep = (1.0 - np.clip((pair - lo) / max(hi - lo, 1e-3), 0.0, 1.0)) * self.ext_factor  # [rope_dim / 2]
        return 1.0 / (keep + (1.0 - keep) / self.factor)

    @property
    def magnitude(self) -> float:
        """cos and sin times this: the file's yarn_attn_factor if it has one, else 0.1 ln(factor) + 1 (divided
        by the same with `log_multiplier` in place of 1 when the file gives one); 1 when nothing is kept
        (ext_factor 0: plain interpolation, which llama.cpp leaves unscaled)."""
        if self.attn_factor:
            return self.attn_factor
        if self.ext_factor == 0.0:
            return 1.0

        def mscale(m: float) -> float:
            return 1.0 if self.factor <= 1 else 0.1 * m * math.log(self.factor) + 1.0

        return mscale(1.0) / mscale(self.log_multiplier) if self.log_multiplier else mscale(1.0)


def read_yarn(metadata: dict, arch: str, context_length: int) -> Yarn:
    """The YaRN parameters of a file whose rope.scaling.type is yarn (defaults: llama.cpp's)."""
    def key(name: str, default):
        value = metadata.get(f"{arch}.rope.scaling.{name}")
        return default if value is None else value

    factor = float(key("factor", 0.0))
    if factor == 0.0:
        raise ValueError(f"RoPE scaling 'yarn' needs {arch}.rope.scaling.factor")
    return Yarn(factor=factor, original_context=int(key("original_context_length", context_length)),
                beta_fast=float(key("yarn_beta_fast", 32.0)), beta_slow=float(key("yarn_beta_slow", 1.0)),
                ext_factor=float(key("yarn_ext_factor", 1.0)), attn_factor=float(key("yarn_attn_factor", 0.0)),
                log_multiplier=float(key("yarn_log_multiplier", 0.0)))
