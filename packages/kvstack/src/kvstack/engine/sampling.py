"""Picking the next token: greedy, or seeded temperature / top-k / top-p sampling.

Each sampled request owns a ``torch.Generator`` seeded from its :class:`SamplingParams`, so its
tokens depend only on its own logits and seed, never on which requests shared its batch (the
property continuous batching needs for reproducible sampling).
"""

from __future__ import annotations

import difflib
import math
import numbers
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, fields
from typing import Any

import torch

__all__ = [
    "MAX_SEED",
    "MIN_TEMPERATURE",
    "SamplingParams",
    "check_keywords",
    "make_generator",
    "sample",
]


#: ``torch.Generator.manual_seed`` takes unsigned 64-bit seeds.
MAX_SEED = 2**64 - 1
#: The smallest non-zero temperature (vLLM's sampling epsilon): below it ``logits / t`` overflows.
MIN_TEMPERATURE = 1e-5


def _is_int(v: object) -> bool:
    """A real integer (``numbers.Integral``: int, numpy ints), never a bool."""
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def _is_real(v: object) -> bool:
    """A real number (int or float, numpy scalars included), never a bool."""
    return isinstance(v, numbers.Real) and not isinstance(v, bool)


def check_keywords(what: str, given: Iterable[str], valid: Iterable[str]) -> None:
    """A ``TypeError`` naming each keyword of ``given`` that is not in ``valid``, with the
    closest valid name (difflib) and every valid one."""
    names = sorted(valid)
    unknown = [k for k in given if k not in names]
    if not unknown:
        return
    parts = []
    for k in unknown:
        close = difflib.get_close_matches(k, names, n=1)
        parts.append(f"{k!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
    raise TypeError(
        f"{what}: unknown option{'s' if len(unknown) > 1 else ''} {', '.join(parts)}; "
        f"valid options: {', '.join(names)}"
    )


@dataclass(frozen=True)
class SamplingParams:
    """How one request generates. Every field is checked when made (a ``TypeError`` for a wrong
    type, a ``ValueError`` for a value out of range, each naming the field, the value and the
    bound); nothing is converted except ``stop_token_ids`` / ``stop`` lists into tuples.

    - ``max_new_tokens``: tokens to generate, an int >= 1 (it stops earlier on a stop token or
      string).
    - ``temperature``: ``0`` or a finite number >= :data:`MIN_TEMPERATURE`; ``0`` is greedy (argmax; ``top_k``/``top_p``/
      ``seed`` unused).
    - ``top_k``: keep the ``k`` most likely tokens (an int >= 0; ``0``: all). ``top_p``: keep the
      smallest set whose probability reaches ``p``, in ``(0, 1]`` (``1.0``: all). Both apply
      after the temperature.
    - ``seed``: an int in ``[0, 2**64 - 1]`` seeding the request's own generator (``None``: drawn
      from torch's global RNG once).
    - ``stop_token_ids``: token ids (ints >= 0; the engine checks them against the vocabulary)
      that finish the request when generated (the token is kept in the output); ``ignore_eos``
      drops the model's EOS ids from the stop set (random-weight models, benchmarks).
    - ``stop``: strings that finish the request when the decoded output contains one (vLLM's
      rule: the output text ends before it, unless ``include_stop_str_in_output``; the token ids
      keep every generated token). A single string counts as one stop string, as in vLLM. Needs
      the engine's tokenizer.
    """

    max_new_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    stop: tuple[str, ...] = ()
    include_stop_str_in_output: bool = False

    def __new__(cls, *args: Any, **kwargs: Any) -> SamplingParams:
        # The dataclass __init__ would say only "unexpected keyword argument": name the fix.
        check_keywords("SamplingParams", kwargs, (f.name for f in fields(cls)))
        return super().__new__(cls)

    def __post_init__(self) -> None:
        v = self.max_new_tokens
        if not _is_int(v):
            raise TypeError(
                f"SamplingParams.max_new_tokens={v!r} is a {type(v).__name__}; give an int >= 1"
            )
        if v < 1:
            raise ValueError(f"SamplingParams.max_new_tokens={v!r} must be an int >= 1")
        t = self.temperature
        if not _is_real(t):
            raise TypeError(
                f"SamplingParams.temperature={t!r} is a {type(t).__name__}; give a finite "
                "number >= 0 (0 = greedy)"
            )
        try:
            tf = float(t)
        except OverflowError:  # an int past float's range
            tf = math.inf
        if not (math.isfinite(tf) and tf >= 0):
            raise ValueError(
                f"SamplingParams.temperature={t!r} must be a finite number >= 0 (0 = greedy)"
            )
        if 0 < tf < MIN_TEMPERATURE:
            raise ValueError(
                f"SamplingParams.temperature={t!r} is below {MIN_TEMPERATURE} (logits / t "
                "overflow to inf); give 0 for greedy or a temperature >= "
                f"{MIN_TEMPERATURE}"
            )
        k = self.top_k
        if not _is_int(k):
            raise TypeError(
                f"SamplingParams.top_k={k!r} is a {type(k).__name__}; give an int >= 0 (0 = off)"
            )
        if k < 0:
            raise ValueError(f"SamplingParams.top_k={k!r} must be an int >= 0 (0 = off)")
        p = self.top_p
        if not _is_real(p):
            raise TypeError(
                f"SamplingParams.top_p={p!r} is a {type(p).__name__}; give a number in (0, 1] "
                "(1 = off)"
            )
        if not 0 < p <= 1:  # nan fails too
            raise ValueError(f"SamplingParams.top_p={p!r} must be in (0, 1] (1 = off)")
        seed = self.seed
        if seed is not None and not _is_int(seed):
            raise TypeError(
                f"SamplingParams.seed={seed!r} is a {type(seed).__name__}; give an int in "
                f"[0, 2**64 - 1] or None"
            )
        if seed is not None and not 0 <= seed <= MAX_SEED:
            raise ValueError(
                f"SamplingParams.seed={seed!r} is outside [0, 2**64 - 1 = {MAX_SEED}] (torch "
                "seeds are unsigned 64-bit); give a seed in that range"
            )
        for name in ("ignore_eos", "include_stop_str_in_output"):
            b = getattr(self, name)
            if not isinstance(b, bool):
                raise TypeError(
                    f"SamplingParams.{name}={b!r} is a {type(b).__name__}; give True or False"
                )
        # numpy scalars -> Python numbers (exact: checked integral / real above).
        object.__setattr__(self, "max_new_tokens", int(v))
        object.__setattr__(self, "temperature", tf)
        object.__setattr__(self, "top_k", int(k))
        object.__setattr__(self, "top_p", float(p))
        object.__setattr__(self, "seed", None if seed is None else int(seed))
        object.__setattr__(self, "stop_token_ids", self._stop_token_ids(self.stop_token_ids))
        object.__setattr__(self, "stop", self._stop_strings(self.stop))

    @staticmethod
    def _stop_token_ids(ids: object) -> tuple[int, ...]:
        if isinstance(ids, (str, bytes)) or not isinstance(ids, Iterable):
            raise TypeError(
                f"SamplingParams.stop_token_ids={ids!r} is a {type(ids).__name__}; give a list "
                "of token ids (ints >= 0)"
            )
        out = tuple(ids)
        for i, t in enumerate(out):
            if not _is_int(t):
                raise TypeError(
                    f"SamplingParams.stop_token_ids[{i}]={t!r} is a {type(t).__name__}; token "
                    "ids are ints >= 0"
                )
            if t < 0:
                raise ValueError(
                    f"SamplingParams.stop_token_ids[{i}]={t!r} is negative; token ids are >= 0"
                )
        return tuple(int(t) for t in out)  # numpy ints -> int (exact)

    @staticmethod
    def _stop_strings(stop: object) -> tuple[str, ...]:
        if isinstance(stop, str):
            stop = (stop,)
        if not isinstance(stop, Iterable) or isinstance(stop, bytes):
            raise TypeError(
                f"SamplingParams.stop={stop!r} is a {type(stop).__name__}; give a string or a "
                "list of strings"
            )
        out = tuple(stop)
        for i, s in enumerate(out):
            if not isinstance(s, str):
                raise TypeError(
                    f"SamplingParams.stop[{i}]={s!r} is a {type(s).__name__}; stop strings are "
                    "str (stop token ids go in stop_token_ids)"
                )
            if not s:
                raise ValueError(
                    f"SamplingParams.stop[{i}] is the empty string, which would stop every "
                    "request at once; remove it"
                )
        return out

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def make_generator(params: SamplingParams, device: torch.device | str) -> torch.Generator | None:
    """The request's own generator (``None`` for greedy requests: they draw nothing)."""
    if params.greedy:
        return None
    gen = torch.Generator(device=device)
    seed = params.seed if params.seed is not None else int(torch.randint(0, 2**62, ()).item())
    gen.manual_seed(seed)
    return gen


def _filter(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """``logits`` ``[V]`` with everything outside top-k / top-p set to ``-inf``."""
    if top_k and top_k < logits.numel():
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # Drop a token when the mass before it already reaches top_p (the first one always stays).
        drop = (torch.cumsum(probs, dim=-1) - probs) >= top_p
        # Back to vocabulary order through the sort's permutation. (Indexing with the boolean
        # mask, logits[order[drop]], needs the mask's count on the host: a device sync a row.)
        kept = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.empty_like(logits).scatter_(0, order, kept)
    return logits


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
) -> list[int]:
    """One token per row of ``logits`` ``[R, vocab]`` (float32), row ``r`` with ``params[r]``."""
    if logits.dim() != 2 or logits.shape[0] != len(params) or len(params) != len(generators):
        raise ValueError(
            f"sample: logits {tuple(logits.shape)} must be [R, vocab] with R = len(params) = "
            f"len(generators) (got {len(params)} and {len(generators)})"
        )
    tokens = logits.argmax(dim=-1)  # greedy rows: one batched argmax
    for r, (p, gen) in enumerate(zip(params, generators, strict=True)):
        if p.greedy:
            continue
        row = _filter(logits[r].float() / p.temperature, p.top_k, p.top_p)
        probs = torch.softmax(row, dim=-1)
        # (written on the device: an .item() a sampled row was a device sync each)
        tokens[r] = torch.multinomial(probs, 1, generator=gen)[0]
    return tokens.tolist()  # the step's one sync; Python ints
