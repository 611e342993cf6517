"""OpenAI response bodies and stream chunks built from engine `Output`s.

One `ResponseBuilder` per choice (a request with `n` choices runs n engine requests): it turns each
engine output into chunks (streaming) and also accumulates the whole answer (non-streaming);
`response` and `usage` merge the choices. With tools, the answer's `<tool_call>` blocks become
`tool_calls` (`gateway.tool_calls`).
"""

from __future__ import annotations

import time

import msgspec

from engine.serving import protocol
from gateway import tool_calls
from gateway.validation import RequestOptions


class ResponseBuilder:
    def __init__(self, request_id: str, model: str, opts: RequestOptions, index: int = 0, counts_prompt: bool = True):
        self.request_id = request_id
        self.index = index  # the choice's index in the response
        self.counts_prompt = counts_prompt  # the first choice of its prompt: usage counts the prompt here
        self.model = model
        self.opts = opts
        self.created = int(time.time())
        self.is_chat = opts.kind == "chat"
        self.object = "chat.completion" if self.is_chat else "text_completion"
        self.chunk_object = "chat.completion.chunk" if self.is_chat else "text_completion"
        self.text_parts: list[str] = []
        self.num_token_chars = 0  # completions logprobs: text_offset runs over the whole answer
        self.logprob_items: list[protocol.TokenLogprob] = []
        self.token_ids: list[int] = []
        self.drafted: list[bool] = []
        self.grammar: list[bool] = []  # with provenance: accepted drafts the grammar forced
        self.finish_reason: str | None = None
        self.last: protocol.Output | None = None
        self.prompt_entries: list[protocol.TokenLogprob] | None = None  # vLLM's prompt_logprobs, when asked
        self.tool_names = opts.tool_names if self.is_chat else ()
        self.tool_stream = tool_calls.ToolCallStream(self.tool_names) if self.tool_names else None

    # ------------------------------------------------------------ streaming

    def _chunk(self, choices: list[dict]) -> dict:
        return {"id": self.request_id, "object": self.chunk_object, "created": self.created,
                "model": self.model, "choices": choices}

    def opening_chunks(self) -> list[dict]:
        """Chat streams open with the assistant role and empty content, as OpenAI and vLLM do; with vLLM's echo,
        the echoed message's text follows in a chunk of its own."""
        delta = {"role": "assistant", "content": ""}
        chunks = [self._chunk([{"index": self.index, "delta": delta, "logprobs": None, "finish_reason": None}])]
        if self.opts.echo_text:
            chunks.append(self._delta_chunk({"content": self.opts.echo_text}))
        return chunks

    def chunks(self, out: protocol.Output) -> list[dict]:
        """The chunks for one engine output (none when it carries nothing to show).

        With tools, content that may still be a call is held back; the last output brings it, then
        one chunk per call (`delta.tool_calls`), then the finish reason ("tool_calls" after calls).
        """
        if self.tool_stream is None:
            return _present(self.chunk(out))
        text = self.tool_stream.feed(out.text)
        if out.finish_reason is None:
            return _present(self._output_chunk(out, text, None))
        tail, calls = self.tool_stream.finish()
        if not calls:
            return _present(self._output_chunk(out, text + tail, out.finish_reason))
        found = _present(self._output_chunk(out, text + tail, None))
        found += [self._delta_chunk({"tool_calls": [delta]}) for delta in tool_calls.stream_deltas(calls)]
        return [*found, self._delta_chunk({}, tool_calls.finish_reason(out.finish_reason, calls))]

    def _delta_chunk(self, delta: dict, finish_reason: str | None = None) -> dict:
        return self._chunk([{"index": self.index, "delta": delta, "logprobs": None, "finish_reason": finish_reason}])

    def chunk(self, out: protocol.Output) -> dict | None:
        """The chunk for one engine output, or None when it carries nothing to show (no tool parsing)."""
        return self._output_chunk(out, out.text, out.finish_reason)

    def _output_chunk(self, out: protocol.Output, text: str, finish_reason: str | None) -> dict | None:
        offset = self.num_token_chars
        self.add(out)
        shown, items, token_ids = self._visible(out)
        if not self.is_chat:  # completions: with echo, the prompt comes first (chat passes the tool stream's text)
            text = shown
        if not (text or finish_reason or (token_ids and (items or self.opts.provenance))):
            return None
        logprobs = self._logprobs(items, offset) if self.opts.logprobs is not None else None
        if self.is_chat:
            choice = {"index": self.index, "delta": {"content": text} if text else {}}
        else:
            choice = {"index": self.index, "text": text}
        choice["logprobs"] = logprobs
        choice["finish_reason"] = finish_reason
        chunk = self._chunk([choice])
        if self.opts.provenance:
            chunk["speculant"] = {"token_ids": token_ids, "drafted": list(out.drafted or []) if token_ids else [],
                                  "grammar": list(out.grammar_forced or []) if token_ids else []}
        return chunk

    def _visible(self, out: protocol.Output) -> tuple[str, list[protocol.TokenLogprob], list[int]]:
        """(text, logprob entries, token ids) a client sees of an output: with echo, the prompt first (on the
        first output); with echo and max_tokens 0, nothing generated."""
        if self.opts.echo_only:
            text, items, token_ids = "", [], []
        else:
            text, items, token_ids = out.text, list(out.logprobs or []), list(out.token_ids)
        if self.opts.echo and out.prompt_text is not None:
            text, items = out.prompt_text + text, _at_most(out.prompt_logprobs, self.opts.logprobs) + items
        return text, items, token_ids

    # ------------------------------------------------------------ whole answer

    def add(self, out: protocol.Output) -> None:
        text, items, token_ids = self._visible(out)
        self.text_parts.append(text)
        self.logprob_items.extend(items)
        self.num_token_chars += sum(len(item.token) for item in items)
        self.token_ids.extend(token_ids)
        if token_ids:
            self.drafted.extend(out.drafted or [])
            self.grammar.extend(out.grammar_forced or [])
        self.finish_reason = out.finish_reason or self.finish_reason
        self.last = out
        if out.prompt_logprobs is not None and self.opts.prompt_logprobs is not None:
            self.prompt_entries = out.prompt_logprobs

    def choice(self) -> dict:
        """This choice of the whole answer (its provenance, if asked, under `speculant`)."""
        text = "".join(self.text_parts)
        logprobs = self._logprobs(self.logprob_items, 0) if self.opts.logprobs is not None else None
        finish_reason = self.finish_reason
        if self.tool_names:
            content, calls = tool_calls.parse_tool_calls(text, self.tool_names)
            if self.opts.echo_text:
                content = self.opts.echo_text + (content or "")
            choice = {"index": self.index, "message": {"role": "assistant", "content": content}}
            if calls:
                choice["message"]["tool_calls"] = calls
            finish_reason = tool_calls.finish_reason(finish_reason, calls)
        elif self.is_chat:
            choice = {"index": self.index, "message": {"role": "assistant", "content": self.opts.echo_text + text}}
        else:
            choice = {"index": self.index, "text": text}
        choice["logprobs"] = logprobs
        choice["finish_reason"] = finish_reason
        if self.opts.prompt_logprobs is not None and not self.is_chat:  # chat's: once, at the top level
            choice["prompt_logprobs"] = self.prompt_logprobs()
        if self.opts.provenance:
            choice["speculant"] = {"token_ids": self.token_ids, "drafted": self.drafted, "grammar": self.grammar}
        return choice

    # ------------------------------------------------------------ logprobs

    def prompt_logprobs(self) -> list[dict | None]:
        """vLLM's prompt_logprobs: per prompt token, None for the first, else {token id: {logprob, rank,
        decoded_token}} for the token itself and then its top alternatives."""
        k = self.opts.prompt_logprobs or 0
        return [None if e.logprob is None else _prompt_entry(e, k) for e in self.prompt_entries or []]

    def _logprobs(self, items: list[protocol.TokenLogprob], text_offset: int) -> dict:
        named = _token_id_names if self.opts.tokens_as_ids else _token_texts
        if self.is_chat:
            return {"content": [_chat_logprob(item, named) for item in items], "refusal": None}
        return _completion_logprobs(items, text_offset, named)


def usage(builders: list[ResponseBuilder]) -> dict:
    """The usage of a request's choices: each prompt once, the completions and speculation summed."""
    last = [b.last for b in builders if b.last is not None]
    prompt = sum(b.last.prompt_tokens for b in builders if b.last is not None and b.counts_prompt)
    completion = sum(b.last.completion_tokens for b in builders if b.last is not None and not b.opts.echo_only)
    num_drafts = sum(out.num_drafts for out in last)
    num_accepted = sum(out.num_accepted_tokens for out in last)
    speculative = {
        "num_drafts": num_drafts,
        "num_draft_tokens": sum(out.num_draft_tokens for out in last),
        "num_accepted_tokens": num_accepted,
        "num_grammar_tokens": sum(out.num_grammar_tokens for out in last),  # accepted drafts the grammar forced
        # vLLM's convention: the bonus/recovered token counts, so 1 + accepted per draft.
        "mean_acceptance_length": round(1 + num_accepted / num_drafts, 4) if num_drafts else None,
    }
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion, "speculative": speculative}


def usage_chunk(builders: list[ResponseBuilder]) -> dict:
    chunk = builders[0]._chunk([])
    chunk["usage"] = usage(builders)
    return chunk


def response(builders: list[ResponseBuilder]) -> dict:
    """The whole answer: every choice, in index order. With one choice its provenance also stays at the
    top level, where it was before `n`."""
    first = builders[0]
    choices = [b.choice() for b in builders]
    body = {"id": first.request_id, "object": first.object, "created": first.created, "model": first.model,
            "choices": choices, "usage": usage(builders)}
    if first.opts.prompt_logprobs is not None and first.is_chat:
        body["prompt_logprobs"] = first.prompt_logprobs()  # vLLM's place for chat: one conversation, one list
    if first.opts.provenance and len(builders) == 1:
        body["speculant"] = choices[0].pop("speculant")
    return body


def _at_most(entries: list[protocol.TokenLogprob] | None, k: int | None) -> list[protocol.TokenLogprob]:
    """Echo's prompt entries with at most k alternatives each (prompt_logprobs may have asked for more);
    none when echo's logprobs are off."""
    if k is None or not entries:
        return []
    return [e if len(e.top) <= k else msgspec.structs.replace(e, top=e.top[:k]) for e in entries]


def _prompt_entry(e: protocol.TokenLogprob, k: int) -> dict:
    entry = {str(e.token_id): {"logprob": e.logprob, "rank": e.rank, "decoded_token": e.token}}
    for rank, (token_id, token, logprob) in enumerate(e.top[:k], start=1):
        entry.setdefault(str(token_id), {"logprob": logprob, "rank": rank, "decoded_token": token})
    return entry


def _present(chunk: dict | None) -> list[dict]:
    return [] if chunk is None else [chunk]


def token_bytes(token: str) -> list[int]:
    """UTF-8 bytes of a token; a partial character arrives as OpenAI's `bytes:\\xNN...` text."""
    if token.startswith("bytes:"):
        try:
            return list(bytes.fromhex(token[len("bytes:"):].replace("\\x", "")))
        except ValueError:  # ordinary text that happens to start with "bytes:"
            pass
    return list(token.encode())


def _token_texts(token_id: int, text: str) -> str:
    return text


def _token_id_names(token_id: int, text: str) -> str:
    """vLLM's return_tokens_as_token_ids: a token named by its id (bytes and text offsets stay the text's)."""
    return f"token_id:{token_id}"


def _chat_logprob(item: protocol.TokenLogprob, named=_token_texts) -> dict:
    top = [{"token": named(tid, text), "logprob": lp, "bytes": token_bytes(text)} for tid, text, lp in item.top]
    return {"token": named(item.token_id, item.token), "logprob": item.logprob, "bytes": token_bytes(item.token),
            "top_logprobs": top}


def _completion_logprobs(items: list[protocol.TokenLogprob], text_offset: int, named=_token_texts) -> dict:
    """Legacy completions format; `text_offset` counts characters from the start of the answer."""
    offsets = []
    for item in items:
        offsets.append(text_offset)
        text_offset += len(item.token)
    return {
        "tokens": [named(item.token_id, item.token) for item in items],
        "token_logprobs": [item.logprob for item in items],
        "top_logprobs": [{named(tid, text): lp for tid, text, lp in item.top} for item in items],
        "text_offset": offsets,
    }
