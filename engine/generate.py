"""Drive an LLMEngine in-process: `generate()` for tests and `speculant generate` for quick checks."""

from __future__ import annotations

import itertools
import sys
from dataclasses import dataclass, field

from engine.serving.protocol import ChatMessage, Generate, SamplingParams

_ids = itertools.count()


@dataclass
class Completion:
    request_id: str
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    prompt_tokens: int = 0
    logprobs: list = field(default_factory=list)
    drafted: list[bool] = field(default_factory=list)
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_grammar_tokens: int = 0  # accepted drafts a grammar forced
    num_steps: int = 0


def generate(engine, prompts: list, params: SamplingParams | list[SamplingParams]) -> list[Completion]:
    """Run prompts (str, token-id list, or list of ChatMessage) concurrently to completion."""
    params_list = params if isinstance(params, list) else [params] * len(prompts)
    results: dict[str, Completion] = {}
    for prompt, p in zip(prompts, params_list):
        rid = f"gen-{next(_ids)}"
        if isinstance(prompt, str):
            msg = Generate(rid, p, prompt=prompt)
        elif prompt and isinstance(prompt[0], ChatMessage):
            msg = Generate(rid, p, messages=list(prompt))
        else:
            msg = Generate(rid, p, prompt_token_ids=[int(t) for t in prompt])
        engine.add_request(msg)
        results[rid] = Completion(rid)
    while engine.has_unfinished():
        for out in engine.step():
            c = results[out.request_id]
            c.text += out.text
            c.token_ids += out.token_ids
            c.finish_reason = out.finish_reason
            c.prompt_tokens = out.prompt_tokens
            c.logprobs += out.logprobs or []
            c.drafted += out.drafted or []
            c.num_draft_tokens, c.num_accepted_tokens = out.num_draft_tokens, out.num_accepted_tokens
            c.num_grammar_tokens = out.num_grammar_tokens
            c.num_steps += 1
    return list(results.values())


def cli_generate(args) -> int:
    from engine.llm_engine import LLMEngine

    engine = LLMEngine.from_args(args)
    prompt = [ChatMessage("user", args.prompt)] if args.chat else args.prompt
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature)
    (c,) = generate(engine, [prompt], params)
    sys.stdout.write(c.text + "\n")
    if c.num_draft_tokens:
        sys.stderr.write(f"[{c.num_accepted_tokens}/{c.num_draft_tokens} draft tokens accepted in {c.num_steps} steps]\n")
    return 0
