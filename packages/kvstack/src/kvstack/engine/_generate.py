"""The engine's prompt-level API over ``add_request`` / ``step``: :meth:`~RunsPrompts.generate`,
:meth:`~RunsPrompts.stream` and :meth:`~RunsPrompts.chat` (a base class of
:class:`~kvstack.engine.LLMEngine`, which sets the attributes below)."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeAlias

from kvstack.engine._inputs import chat_prompts, prompts_and_params
from kvstack.engine.outputs import Completion, TokenEvent
from kvstack.engine.sampling import SamplingParams
from kvstack.engine.scheduler import Sequence as Seq

if TYPE_CHECKING:
    from kvstack.engine.scheduler import Scheduler
    from kvstack.engine.tokenizer import TextTokenizer

__all__ = ["Message", "Prompt", "RunsPrompts"]

#: A prompt: token ids, or text the engine's tokenizer encodes.
Prompt: TypeAlias = "Sequence[int] | str"
#: One chat message: ``{"role": "user", "content": "..."}``.
Message: TypeAlias = Mapping[str, Any]


class RunsPrompts:
    """Run prompts to completion through the engine's own request API."""

    scheduler: Scheduler
    _seqs: dict[str, Seq]
    _ids: itertools.count[int]

    if TYPE_CHECKING:  # (the engine's own, declared for the type checker only)

        def add_request(
            self, request_id: str, prompt: Prompt, params: SamplingParams | None = None
        ) -> str: ...

        def step(self) -> list[TokenEvent]: ...

        def abort_request(self, request_id: str | Sequence[str]) -> list[str]: ...

        def completion(self, request_id: str) -> Completion: ...

        def _forget(self, rid: str) -> None: ...

        def _require_tokenizer(self, what: str) -> TextTokenizer: ...

    def _run(
        self,
        prompts: Sequence[Prompt] | str,
        params: SamplingParams | Sequence[SamplingParams] | None,
        added: list[str],
    ) -> Iterator[TokenEvent]:
        """Add ``prompts`` as requests ``"0"``, ``"1"``, ... (``"0-7"`` where a connector still
        holds an earlier ``"0"``'s blocks; ids go to ``added`` as they are added) and step until
        each has finished; yield their tokens. Other requests in the engine run along; their
        events are not yielded (read them with :meth:`completion`)."""
        plist_prompts, plist = prompts_and_params(prompts, params)
        for i, (p, sp) in enumerate(zip(plist_prompts, plist, strict=True)):
            rid = f"{i}-{next(self._ids)}" if str(i) in self.scheduler.sending else str(i)
            added.append(self.add_request(rid, p, sp))
        mine = set(added)

        def unfinished() -> bool:
            return any(
                (s := self._seqs.get(r)) is not None and s.finish_reason is None for r in added
            )

        while unfinished():
            for ev in self.step():
                if ev.request_id in mine:
                    yield ev

    def stream(
        self,
        prompts: Sequence[Prompt] | str,
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> Iterator[TokenEvent]:
        """Add ``prompts`` (ids ``"0"``, ``"1"``, ...; text or token ids) and yield each token as
        it is generated. When the iteration ends -- run out, closed early (``break``, ``close()``)
        or on an error -- its requests leave the engine: finished ones are forgotten, unfinished
        ones aborted (their blocks freed), so the engine can run the same ids again."""
        added: list[str] = []
        try:
            yield from self._run(prompts, params, added)
        finally:
            self._leave(added)

    def generate(
        self,
        prompts: Sequence[Prompt] | str,
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[Completion]:
        """Run ``prompts`` (text or token ids; one string is one prompt) to completion; one
        :class:`Completion` per prompt, in order, with its decoded ``text`` when the engine has a
        tokenizer. On an error, every request it added leaves the engine."""
        added: list[str] = []
        try:
            for _ in self._run(prompts, params, added):
                pass
            return [self.completion(r) for r in added]
        finally:
            self._leave(added)  # only what an error left: completion() forgot the rest

    def _leave(self, added: list[str]) -> None:
        """A generate/stream call's requests leave (blocks a connector still sends stay held)."""
        for r in added:
            if r in self.scheduler.sending:
                self._forget(r)
        self.abort_request([r for r in added if r not in self.scheduler.sending])

    def chat(
        self,
        messages: Sequence[Message] | Sequence[Sequence[Message]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        add_generation_prompt: bool = True,
    ) -> list[Completion]:
        """Generate replies to conversations (``[{"role": "user", "content": "hi"}, ...]``, or a
        list of them), each rendered by the tokenizer's chat template (its ``prompt_text``) and
        encoded without adding special tokens again (the template writes them), as vLLM's
        ``LLM.chat`` does."""
        tok = self._require_tokenizer("chat")
        texts, prompts = chat_prompts(tok, messages, add_generation_prompt)
        out = self.generate(prompts, params)
        return [dataclasses.replace(c, prompt_text=t) for c, t in zip(out, texts, strict=True)]
