"""Checks of what callers hand :class:`~kvstack.engine.engine.LLMEngine`: token ids, engine
flags, chat messages. Each failure names the field, the value, the bound and the fix; nothing is
rounded, parsed or otherwise coerced (numpy integers are taken as the ints they are)."""

from __future__ import annotations

import numbers
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from kvstack.engine.sampling import SamplingParams
from kvstack.engine.tokenizer import TextTokenizer

__all__ = ["chat_prompts", "check_engine_flags", "check_token_ids", "prompts_and_params"]


def check_token_ids(rid: str, prompt: object, vocab: int) -> list[int]:
    """``prompt`` as a list of ints, each in ``[0, vocab)``."""
    if isinstance(prompt, (bytes, bytearray)) or not isinstance(prompt, Sequence):
        raise TypeError(
            f"request {rid!r}: the prompt is a {type(prompt).__name__} ({prompt!r:.60}); give "
            "text (str) or a list of int token ids"
            + (" (a torch tensor: pass tensor.tolist())" if torch.is_tensor(prompt) else "")
            + (
                " (generate and stream take a list of prompts: [[1, 2, 3]] for one)"
                if isinstance(prompt, numbers.Integral)
                else ""
            )
        )
    # Fast path (an 8k-token prompt: ~0.3 ms against ~4 ms for the checks below, which name the
    # first bad id): plain ints, the extremes in the vocabulary.
    if all(type(t) is int for t in prompt) and (
        not prompt or (min(prompt) >= 0 and max(prompt) < vocab)
    ):
        return list(prompt)
    for i, t in enumerate(prompt):
        if isinstance(t, bool) or not isinstance(t, numbers.Integral):
            raise TypeError(
                f"request {rid!r}: prompt token {i} is {t!r} ({type(t).__name__}); token ids "
                f"are ints in [0, {vocab}), never rounded or parsed"
            )
    bad = [int(t) for t in prompt if not 0 <= t < vocab]
    if bad:
        raise ValueError(
            f"request {rid!r}: token ids {bad[:5]} are outside the vocabulary [0, {vocab}); "
            f"give ids below {vocab}"
        )
    return [int(t) for t in prompt]


def check_engine_flags(
    max_num_seqs: object,
    enable_prefix_caching: object,
    keep_logits: object,
    tokenizer: object,
    warmup: object = True,
    freeze_gc: object = True,
) -> None:
    if not (
        tokenizer is None
        or isinstance(tokenizer, (str, Path))
        or (hasattr(tokenizer, "encode") and hasattr(tokenizer, "decode"))
    ):
        raise TypeError(
            f"LLMEngine: tokenizer={tokenizer!r:.60} is a {type(tokenizer).__name__}; give "
            "None (the checkpoint's), a directory, or a tokenizer with encode/decode"
        )
    if isinstance(max_num_seqs, bool) or not isinstance(max_num_seqs, int):
        raise TypeError(
            f"LLMEngine: max_num_seqs={max_num_seqs!r} is a {type(max_num_seqs).__name__}; "
            "give an int >= 1"
        )
    if max_num_seqs < 1:
        raise ValueError(f"LLMEngine: max_num_seqs={max_num_seqs} must be an int >= 1")
    for name, flag in (
        ("enable_prefix_caching", enable_prefix_caching),
        ("keep_logits", keep_logits),
        ("warmup", warmup),
        ("freeze_gc", freeze_gc),
    ):
        if not isinstance(flag, bool):
            raise TypeError(
                f"LLMEngine: {name}={flag!r} is a {type(flag).__name__}; give True or False"
            )


def chat_prompts(
    tok: TextTokenizer, messages: Any, add_generation_prompt: bool
) -> tuple[list[str], list[list[int]]]:
    """One conversation (a list of message dicts) or several, rendered by the chat template:
    ``(texts, token ids)``, encoded without adding special tokens (the template writes them)."""
    if not isinstance(messages, Sequence) or isinstance(messages, (str, bytes)):
        raise TypeError(
            f"chat: messages is a {type(messages).__name__}; give a list of "
            '{"role": ..., "content": ...} dicts, or a list of such lists'
        )
    if not isinstance(add_generation_prompt, bool):
        raise TypeError(
            f"chat: add_generation_prompt={add_generation_prompt!r} is a "
            f"{type(add_generation_prompt).__name__}; give True or False"
        )
    convs = [messages] if not messages or isinstance(messages[0], Mapping) else list(messages)
    if not convs or not all(convs):
        raise ValueError("chat: give at least one conversation of at least one message")
    texts, prompts = [], []
    for i, conv in enumerate(convs):
        if not isinstance(conv, Sequence) or isinstance(conv, (str, bytes)):
            raise TypeError(
                f"chat: conversation {i} is a {type(conv).__name__}; give a list of dicts"
            )
        for j, m in enumerate(conv):
            if not isinstance(m, Mapping) or not {"role", "content"} <= set(m):
                raise TypeError(
                    f"chat: conversation {i} message {j} is {m!r:.60}; each message is a "
                    'dict with "role" and "content"'
                )
        text = tok.apply_chat_template(conv, add_generation_prompt=add_generation_prompt)
        texts.append(text)
        prompts.append(tok.encode(text, add_special_tokens=False))
    return texts, prompts


def prompts_and_params(
    prompts: Sequence[Any] | str,
    params: SamplingParams | Sequence[SamplingParams] | None,
) -> tuple[list[Any], list[SamplingParams]]:
    """``generate`` / ``stream``'s prompts as a list (one string is one prompt) and one
    ``SamplingParams`` per prompt (one given, or ``None``: shared by all)."""
    plist_prompts: list[Any] = [prompts] if isinstance(prompts, str) else list(prompts)
    if params is None or isinstance(params, SamplingParams):
        plist = [params or SamplingParams()] * len(plist_prompts)
    else:
        plist = list(params)
    if len(plist) != len(plist_prompts):
        raise ValueError(f"got {len(plist)} SamplingParams for {len(plist_prompts)} prompts")
    return plist_prompts, plist
