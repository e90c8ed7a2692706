"""Sampled tokens in, `RequestOutput`s out: the engine's side of what a user sees.

Each sampled token is appended to its sequence and checked, in this order: its logprobs are kept,
the grammar accepts it, then the stop conditions (an end token, a stop token id, a stop string
found by the incremental detokenizer, max_tokens, the context length). A request's output is then
made from its sequences' text and tokens: whole, as deltas, or once at the end (`output_kind`).
"""

from __future__ import annotations

import time
from typing import Any

from chatserve.core.sequence import Sequence
from chatserve.engine.request import Request
from chatserve.outputs import CompletionOutput, Logprob, PromptLogprobs, RequestOutput


class OutputProcessor:
    """Owns the live requests' records (`requests`, from `add_request` to their last output) and turns
    what each step sampled into their outputs: token appends, grammar acceptance, stop checks,
    logprobs, detokenized text, the per-request stats (`num_generated_tokens`, `finish_time`) and the
    engine's count of generated tokens.

    # NOTE: the seam for parsing generated text: `_completion` is where one sequence's text becomes a
    # `CompletionOutput`. A reasoning request's tracker (chatserve.reasoning) splits it there into the
    # reasoning and the answer; it is fed each token's text in `_append_token`, where the budget and
    # the grammar's start are decided before the next token is sampled.
    """

    def __init__(self, tokenizer: Any, eos_token_ids: frozenset[int], max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.requests: dict[str, Request] = {}
        self.num_generated_tokens = 0
        # final outputs made between steps (a failed grammar): the next step returns them first
        self._ready: list[RequestOutput] = []
        # request_id -> its prompt logprobs as output entries (made once, when all are computed)
        self._prompt_logprobs: dict[str, PromptLogprobs] = {}

    # ---- tokens ------------------------------------------------------------
    def append_tokens(self, seq: Sequence, token_ids: list[int], logprobs: list[Any]) -> int:
        """Append a sequence's sampled tokens up to the first that ends it (setting finish_reason);
        returns how many it appended (core.scheduler.TokenSink)."""
        kept = 0
        for token, lp in zip(token_ids, logprobs):
            kept += 1
            self._append_token(seq, token, lp)
            if seq.finish_reason is not None:
                break
        return kept

    def _append_token(self, seq: Sequence, token: int, lp: Any) -> None:
        """One sampled (or verified) token into seq: logprobs, grammar, stop checks; sets
        finish_reason when it ends the sequence (the scheduler then finishes it)."""
        seq.token_ids.append(token)
        self.num_generated_tokens += 1
        stats = seq.stats
        if stats.first_token_time is None:
            stats.first_token_time = time.monotonic()
        if seq.logprobs is not None and lp is not None:
            seq.logprobs.append(self._logprob_entry(lp))
            seq.cumulative_logprob += lp.logprob
        if seq.grammar is not None and not seq.grammar.accept(token):
            # The mask allows only tokens the grammar takes, so this is a dead end (a bug or a
            # grammar xgrammar cannot continue): end this request, never the step.
            spec = seq.params.structured_outputs
            kind = spec.kind if spec is not None else "grammar"
            end_sequence(seq, "error", f"structured_outputs.{kind}: the grammar rejected token {token}; generation stopped")
            return
        self._check_stop(seq, token)
        if seq.reasoning is not None:
            # the split moves on with the token's text; what masks the next token may change with it
            seq.reasoning.after_token(seq.detokenizer.text)  # type: ignore[union-attr]
            seq.grammar = seq.reasoning.grammar_now()
        if seq.finish_reason is None and seq.grammar is not None and seq.grammar.is_terminated:
            seq.finish_reason = "stop"  # the grammar has ended (e.g. ignore_eos let its stop token through)
            seq.detokenizer.flush()  # type: ignore[union-attr]

    def _logprob_entry(self, lp: Any) -> dict[int, Logprob]:
        entry = {tid: Logprob(val, rank=r + 1) for r, (tid, val) in enumerate(lp.top)}
        entry[lp.token_id] = Logprob(lp.logprob, rank=lp.rank)
        for tid, item in entry.items():
            item.decoded_token = self.tokenizer.decode([tid])
        return entry

    def _check_stop(self, seq: Sequence, token: int) -> None:
        params = seq.params
        detokenizer = seq.detokenizer
        assert detokenizer is not None
        n_out = seq.num_output_tokens
        can_stop = n_out >= params.min_tokens
        # NOTE: a stop token ends generation before its text is added (as in vLLM), unless
        # include_stop_str_in_output asks for it.
        if can_stop and not params.ignore_eos and token in self.eos_token_ids:
            seq.finish_reason = "stop"
        elif can_stop and params.is_stop_token(token):
            seq.finish_reason, seq.stop_reason = "stop", token
        if seq.finish_reason is not None:
            if params.include_stop_str_in_output:
                detokenizer.add_tokens([token])
            detokenizer.flush()
            return
        update = detokenizer.add_tokens([token])
        if can_stop and update.stop_str is not None:
            seq.finish_reason, seq.stop_reason = "stop", update.stop_str
            return  # the detokenizer already cut the text before the stop string
        elif params.max_tokens is not None and n_out >= params.max_tokens:
            seq.finish_reason = "length"
        elif seq.num_tokens >= self.max_model_len:
            seq.finish_reason = "length"
        if seq.finish_reason is not None:
            detokenizer.flush()

    # ---- outputs -----------------------------------------------------------
    def process(self, updated: list[Sequence]) -> list[RequestOutput]:
        """The outputs of a step whose sampled tokens went to ``updated`` (in order; a request once,
        where its first sequence stands); finished requests leave ``requests``. Outputs made between
        steps come first."""
        outputs = self.drain()
        requests = self.requests
        touched: dict[str, Request] = {}
        for seq in updated:
            touched[seq.request_id] = requests[seq.request_id]
        for req in touched.values():
            out = self.make_output(req)
            if out is not None:
                outputs.append(out)
            if req.finished:
                requests.pop(req.request_id, None)
                self._prompt_logprobs.pop(req.request_id, None)
        return outputs

    def finish_request(self, req: Request) -> RequestOutput | None:
        """A request ended outside a step's tokens (abort, failed grammar): its final output, and its
        record leaves ``requests``."""
        self.requests.pop(req.request_id, None)
        try:
            return self.make_output(req)
        finally:
            self._prompt_logprobs.pop(req.request_id, None)

    def add_ready(self, out: RequestOutput | None) -> None:
        """Hand an output made between steps to the next step's return."""
        if out is not None:
            self._ready.append(out)

    def drain(self) -> list[RequestOutput]:
        """The outputs made between steps, once."""
        ready, self._ready = self._ready, []
        return ready

    def make_output(self, req: Request) -> RequestOutput | None:
        """The request's output now (None when ``output_kind`` has nothing to say yet)."""
        kind = req.params.output_kind
        finished = req.finished
        stats = req.stats
        stats.num_generated_tokens = sum(seq.num_output_tokens for seq in req.seqs)
        if finished and stats.finish_time is None:
            stats.finish_time = time.monotonic()
        if kind == "final_only" and not finished:
            return None
        outs = [out for seq in req.seqs if (out := self._completion(seq, kind)) is not None]
        if not outs:
            return None
        return RequestOutput(
            request_id=req.request_id,
            prompt=req.prompt,
            prompt_token_ids=req.prompt_token_ids,
            outputs=outs,
            finished=finished,
            stats=stats,
            prompt_logprobs=self._prompt_logprobs_of(req, kind),
        )

    def _prompt_logprobs_of(self, req: Request, kind: str) -> PromptLogprobs | None:
        """The request's prompt logprobs once all are computed (on the sequence that computed them), as
        output entries with their decoded tokens; a delta stream carries them in one output only."""
        seq = next((s for s in req.seqs if s.prompt_logprobs is not None), None)
        if seq is None or seq.needs_prompt_logprobs or (kind == "delta" and seq.sent_prompt_logprobs):
            return None
        seq.sent_prompt_logprobs = True
        entries = self._prompt_logprobs.get(req.request_id)
        if entries is None:
            entries = [None if lp is None else self._logprob_entry(lp) for lp in seq.prompt_logprobs]  # type: ignore[union-attr]
            self._prompt_logprobs[req.request_id] = entries
        return entries

    def _completion(self, seq: Sequence, kind: str) -> CompletionOutput | None:
        """One sequence's part of the output: everything so far, or (``delta``) what is new since the
        last output (None when nothing is)."""
        text = seq.detokenizer.text  # type: ignore[union-attr]
        tracker = seq.reasoning
        reasoning: str | None = None
        if tracker is not None:
            # NOTE: the seam for reasoning: `text` is the answer alone, the reasoning goes apart.
            tracker.sync(text, finished=seq.finish_reason is not None)
            text, reasoning = tracker.answer, tracker.reasoning
        tokens = seq.output_token_ids
        logprobs = seq.logprobs
        if kind == "delta":
            text_d, tokens_d = text[seq.sent_text_len :], tokens[seq.sent_token_len :]
            reasoning_d = None if tracker is None else tracker.reasoning_delta()
            logprobs_d = None if logprobs is None else logprobs[seq.sent_token_len :]
            if not text_d and not tokens_d and not reasoning_d and (not seq.is_finished or seq.sent_finish):
                return None
            seq.sent_text_len, seq.sent_token_len = len(text), len(tokens)
            seq.sent_finish = seq.is_finished
            text, tokens, logprobs, reasoning = text_d, tokens_d, logprobs_d, reasoning_d
        else:
            tokens = list(tokens)
            logprobs = None if logprobs is None else list(logprobs)
        return CompletionOutput(
            index=seq.index,
            text=text,
            token_ids=tokens,
            finish_reason=seq.finish_reason,
            stop_reason=seq.stop_reason,
            logprobs=logprobs,
            cumulative_logprob=seq.cumulative_logprob if seq.logprobs is not None else None,
            error=seq.error,
            reasoning=reasoning,
            num_reasoning_tokens=0 if tracker is None else tracker.num_reasoning_tokens,
        )


def end_sequence(seq: Sequence, reason: str, error: str | None = None) -> None:
    """End a sequence with ``reason`` ("abort", "error"): the text held back for a possible stop string
    is final now. (The scheduler's `finish` then frees its blocks.)"""
    seq.finish_reason = reason  # type: ignore[assignment]
    if error is not None:
        seq.error = error
    if seq.detokenizer is not None and not seq.detokenizer.finished:
        seq.detokenizer.flush()
