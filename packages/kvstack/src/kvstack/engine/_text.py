"""The engine's text side: its tokenizer (read on first use) and stop strings."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvstack.engine.scheduler import FinishReason
from kvstack.engine.scheduler import Sequence as Seq
from kvstack.engine.tokenizer import TextTokenizer, missing_tokenizer_reason

if TYPE_CHECKING:
    from kvstack.engine.runner import ModelRunner
    from kvstack.engine.scheduler import Scheduler

__all__ = ["TextSide"]


class TextSide:
    """:class:`~kvstack.engine.LLMEngine`'s tokenizer and stop-string handling (a base class:
    the engine sets the attributes below)."""

    runner: ModelRunner
    scheduler: Scheduler
    _tokenizer_arg: Any
    _tokenizer: TextTokenizer | None
    _tokenizer_read: bool
    _text_cut: dict[str, int]

    @property
    def tokenizer(self) -> TextTokenizer | None:
        """The engine's tokenizer (read on first use; None when there is none)."""
        if not self._tokenizer_read:
            arg = self._tokenizer_arg
            if arg is None:
                self._tokenizer = TextTokenizer.from_dir(self.runner.model_dir)
            elif isinstance(arg, (str, Path)):
                self._tokenizer = TextTokenizer.from_dir(arg)
                if self._tokenizer is None:
                    raise ValueError(
                        f"LLMEngine(tokenizer={str(arg)!r}): {missing_tokenizer_reason(arg)}"
                    )
            else:
                self._tokenizer = (
                    arg
                    if isinstance(arg, TextTokenizer)
                    else TextTokenizer(arg, self.runner.model_dir)  # its chat template
                )
            self._tokenizer_read = True
        return self._tokenizer

    def _require_tokenizer(self, what: str) -> TextTokenizer:
        tok = self.tokenizer
        if tok is None:
            raise ValueError(
                f"{what} needs a tokenizer: {missing_tokenizer_reason(self.runner.model_dir)}; "
                "or give prompts as token ids"
            )
        return tok

    def _stop_string(self, seq: Seq) -> bool:
        """Whether ``seq``'s decoded output now holds one of its stop strings; if so it finishes
        (reason STOP, also when it just finished by length, as in vLLM) and its text's cut is
        kept: before the earliest stop string, or after it with ``include_stop_str_in_output``."""
        tok = self.tokenizer
        assert tok is not None  # add_request required one for stop strings
        text = tok.decode(seq.output_token_ids)
        hits = [(i, len(s)) for s in seq.params.stop if (i := text.find(s)) >= 0]
        if not hits:
            return False
        at, n = min(hits)
        self._text_cut[seq.request_id] = at + n if seq.params.include_stop_str_in_output else at
        was_running = seq.finish_reason is None
        self.scheduler.finish(seq, FinishReason.STOP)
        return was_running
