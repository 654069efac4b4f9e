"""The engine's text side: a checkpoint's tokenizer, behind one small interface.

:func:`load_tokenizer` reads the tokenizer a Hugging Face checkpoint directory holds, as
``kvstack generate`` does: transformers' ``AutoTokenizer`` when transformers is installed (the
``hf`` extra), else a ``tokenizer.json`` through the ``tokenizers`` package, else none.
:class:`TextTokenizer` wraps either with what the engine needs: ``encode``, ``decode``, and a
chat template (transformers renders its own; with ``tokenizers`` alone the template from
``tokenizer_config.json`` / ``chat_template.jinja`` is rendered with jinja2, as transformers does).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = ["TOKENIZER_FILES", "TextTokenizer", "load_tokenizer", "tokenizer_files"]

#: Files a Hugging Face tokenizer is read from.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def _hf_hint() -> str:
    """The command that adds transformers (and the tokenizers it brings) where the user is."""
    from kvstack._hints import install_hint

    return f"add transformers: {install_hint('hf')}"


def tokenizer_files(model_dir: str | Path) -> list[str]:
    """The tokenizer files ``model_dir`` holds."""
    return [f for f in TOKENIZER_FILES if (Path(model_dir) / f).is_file()]


def load_tokenizer(model_dir: str | Path) -> Any | None:
    """A tokenizer read from ``model_dir`` (transformers' ``AutoTokenizer``, else a
    ``tokenizers.Tokenizer`` from ``tokenizer.json``), or None when the directory holds none or
    no library here can read it."""
    root = Path(model_dir)
    if not tokenizer_files(root):
        return None
    try:
        from transformers import AutoTokenizer
    except ImportError:
        pass
    else:
        return AutoTokenizer.from_pretrained(str(root))
    try:
        from tokenizers import Tokenizer
    except ImportError:
        return None
    path = root / "tokenizer.json"
    return Tokenizer.from_file(str(path)) if path.is_file() else None


def missing_tokenizer_reason(model_dir: str | Path) -> str:
    """Why :func:`load_tokenizer` found none in ``model_dir``, with the fix."""
    files = tokenizer_files(model_dir)
    if files:
        return f"{model_dir} has {', '.join(files)} but no library here reads it ({_hf_hint()})"
    return (
        f"{model_dir} holds no tokenizer ({' / '.join(TOKENIZER_FILES)}); copy the model's "
        "tokenizer files there or pass LLMEngine(tokenizer=DIR)"
    )


def _read_config(root: Path | None) -> dict[str, Any]:
    path = None if root is None else root / "tokenizer_config.json"
    if path is None or not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: cannot read it as JSON ({e}); fix or re-download it") from None
    return data if isinstance(data, dict) else {}


def _token_text(value: Any) -> str | None:
    """A special token as ``tokenizer_config.json`` writes it (a string or an AddedToken dict)."""
    if isinstance(value, Mapping):
        value = value.get("content")
    return value if isinstance(value, str) else None


class TextTokenizer:
    """``encode`` / ``decode`` / ``apply_chat_template`` over a transformers or a ``tokenizers``
    tokenizer. ``model_dir`` (where it came from) is read for a chat template when the tokenizer
    has none of its own."""

    def __init__(self, tokenizer: Any, model_dir: str | Path | None = None) -> None:
        if not (hasattr(tokenizer, "encode") and hasattr(tokenizer, "decode")):
            raise TypeError(
                f"tokenizer is a {type(tokenizer).__name__} without encode/decode; give a "
                "transformers tokenizer, a tokenizers.Tokenizer or a checkpoint directory"
            )
        self.tokenizer = tokenizer
        self.model_dir = None if model_dir is None else Path(model_dir)
        #: transformers' tokenizers render their own chat template.
        self._is_hf = hasattr(tokenizer, "apply_chat_template")
        cfg = {} if self._is_hf else _read_config(self.model_dir)
        self._special = {k: _token_text(cfg.get(k)) for k in ("bos_token", "eos_token")}
        template = cfg.get("chat_template")
        jinja = None if self.model_dir is None else self.model_dir / "chat_template.jinja"
        if template is None and jinja is not None and jinja.is_file():
            template = jinja.read_text()
        self._template: str | None = template if isinstance(template, str) else None

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> TextTokenizer | None:
        tok = load_tokenizer(model_dir)
        return None if tok is None else cls(tok, model_dir)

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        out = self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        return [int(t) for t in (out.ids if hasattr(out, "ids") else out)]

    def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return str(self.tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens))

    @property
    def chat_template(self) -> str | None:
        if self._is_hf:
            return getattr(self.tokenizer, "chat_template", None)
        return self._template

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True
    ) -> str:
        """The conversation ``messages`` (``{"role": ..., "content": ...}`` dicts) as the
        prompt text the model's chat template makes of it."""
        if self.chat_template is None:
            where = f" ({self.model_dir})" if self.model_dir is not None else ""
            raise ValueError(
                f"the tokenizer{where} has no chat template (tokenizer_config.json "
                "'chat_template' or chat_template.jinja); format the prompt yourself and call "
                "generate with the text"
            )
        msgs = [dict(m) for m in messages]
        if self._is_hf:
            return str(
                self.tokenizer.apply_chat_template(
                    msgs, tokenize=False, add_generation_prompt=add_generation_prompt
                )
            )
        try:
            from jinja2.sandbox import ImmutableSandboxedEnvironment
        except ImportError:
            raise ValueError(
                f"rendering the chat template needs jinja2 (or transformers): {_hf_hint()}"
            ) from None

        def raise_exception(message: str) -> None:
            raise ValueError(f"the chat template refused the messages: {message}")

        # transformers' settings, so both paths render a template the same way.
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        assert self._template is not None
        return env.from_string(self._template).render(
            messages=msgs, add_generation_prompt=add_generation_prompt, **self._special
        )
