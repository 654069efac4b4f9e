"""``kvstack generate``: greedy (or seeded) generation from a local checkpoint, streamed."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from rich.console import Console

from kvstack.cli._args import bytes_arg, count_arg

__all__ = ["add_parser", "cmd_generate", "load_tokenizer"]


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "generate",
        help="generate from a local Hugging Face checkpoint, streaming tokens",
        description="Loads MODEL_DIR (config.json + *.safetensors) into the reference engine and "
        "streams the continuation of each --prompt: text when a tokenizer can be read from the "
        "directory (tokenizer.json via tokenizers, or transformers: pip install 'kvstack[hf]'), "
        "else token ids. A prompt of space-separated integers is taken as token ids.",
    )
    p.add_argument("model_dir", metavar="MODEL_DIR", type=Path)
    p.add_argument("--prompt", action="append", required=True, help="a prompt (repeat for a batch)")
    p.add_argument("--max-new-tokens", type=count_arg("--max-new-tokens"), default=32)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=count_arg("--top-k", minimum=0), default=0, help="0 = off")
    p.add_argument("--top-p", type=float, default=1.0, help="1.0 = off")
    p.add_argument("--seed", type=int, default=0, help="seed of each request's sampler")
    p.add_argument("--ignore-eos", action="store_true", help="do not stop at the model's EOS")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument(
        "--kv-cache-memory",
        type=bytes_arg,
        default=bytes_arg("64MiB"),
        help="KV pool bytes (default 64MiB)",
    )
    p.add_argument("--block-size", type=count_arg("--block-size"), default=16)
    p.add_argument("--max-model-len", type=count_arg("--max-model-len"), default=None)
    p.set_defaults(func=cmd_generate)


def load_tokenizer(model_dir: Path) -> Any | None:
    """A tokenizer with ``encode``/``decode`` read from ``model_dir``, or None if there is none
    (or no library here can read it)."""
    if not any(
        (model_dir / f).is_file()
        for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
    ):
        return None
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(model_dir))
    except ImportError:
        pass
    try:
        from tokenizers import Tokenizer
    except ImportError:
        return None
    path = model_dir / "tokenizer.json"
    return Tokenizer.from_file(str(path)) if path.is_file() else None


def _encode(tok: Any, text: str) -> list[int]:
    ids = tok.encode(text)
    return list(ids.ids if hasattr(ids, "ids") else ids)


def _as_ids(text: str) -> list[int] | None:
    parts = text.split()
    return [int(p) for p in parts] if parts and all(p.isdigit() for p in parts) else None


def cmd_generate(args: argparse.Namespace, console: Console) -> int:
    if not (args.model_dir / "config.json").is_file():
        raise ValueError(f"{str(args.model_dir)!r} is not a checkpoint directory (no config.json)")
    import torch

    from kvstack.engine.engine import LLMEngine
    from kvstack.engine.sampling import SamplingParams

    tok = load_tokenizer(args.model_dir)
    prompts = []
    for text in args.prompt:
        ids = _as_ids(text)
        if ids is None and tok is None:
            raise ValueError(
                f"{str(args.model_dir)!r} has no tokenizer this install can read, so --prompt must be "
                f"token ids (e.g. --prompt '1 2 3'); got {text[:40]!r}"
            )
        prompts.append(ids if ids is not None else _encode(tok, text))
    params = SamplingParams(
        max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
        top_p=args.top_p, seed=args.seed, ignore_eos=args.ignore_eos,
    )  # fmt: skip
    engine = LLMEngine(
        args.model_dir, device=args.device, dtype=getattr(torch, args.dtype),
        kv_cache_memory=args.kv_cache_memory, block_size=args.block_size,
        max_model_len=args.max_model_len, max_num_seqs=max(1, len(prompts)),
    )  # fmt: skip
    out = sys.stdout
    several = len(prompts) > 1
    texts: dict[str, list[int]] = {}
    for ev in engine.stream(prompts, params):
        toks = texts.setdefault(ev.request_id, [])
        toks.append(ev.token_id)
        if tok is None:
            piece = f"{ev.token_id} "
        else:  # decode the whole output and print what is new (tokens may merge into characters)
            before = tok.decode(toks[:-1]) if len(toks) > 1 else ""
            piece = tok.decode(toks)[len(before) :]
        out.write(f"[{ev.request_id}] {piece}\n" if several else piece)
        out.flush()
    if not several:
        out.write("\n")
    st = engine.stats()
    sys.stderr.write(
        f"{st.num_generated_tokens} tokens in {st.wall_seconds:.2f} s "
        f"({st.tokens_per_second:,.1f} tokens/s); prefix-cache hit rate {st.scheduler.prefix_hit_rate:.0%}\n"
    )
    return 0
