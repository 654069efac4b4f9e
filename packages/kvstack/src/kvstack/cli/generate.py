"""``kvstack generate``: greedy (or seeded) generation from a local checkpoint, streamed."""

from __future__ import annotations

import argparse
import math
import re
import sys
from pathlib import Path
from typing import Any

from rich.console import Console

from kvstack._hints import install_hint
from kvstack.cli._args import bytes_arg, count_arg

__all__ = [
    "KV_CACHE_DTYPES",
    "add_parser",
    "choose_dtype",
    "cmd_generate",
    "load_tokenizer",
    "tokenizer_files",
]

#: Files a Hugging Face tokenizer is read from.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
#: torch.Generator seeds are unsigned 64-bit.
MAX_SEED = 2**64 - 1
_DTYPES = ("auto", "float32", "bfloat16", "float16")
#: ``kvstack.engine.kv_format.KV_CACHE_DTYPES``, spelt out so the CLI starts without torch
#: (a test holds them equal).
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")


def _temperature(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(
            f"--temperature={text!r} must be a finite number >= 0 (0 = greedy)"
        )
    return value


def _top_p(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 < value <= 1:  # nan fails too
        raise argparse.ArgumentTypeError(f"--top-p={text!r} must be in (0, 1] (1 = off)")
    return value


def _seed(text: str) -> int:
    if not re.fullmatch(r"\s*\+?[0-9]+\s*", text):
        raise argparse.ArgumentTypeError(f"--seed={text!r} must be a whole number in [0, 2^64 - 1]")
    value = int(text)
    if value > MAX_SEED:
        raise argparse.ArgumentTypeError(
            f"--seed={text!r} is beyond 2^64 - 1 = {MAX_SEED} (torch seeds are 64-bit); "
            "give a smaller seed"
        )
    return value


def _prompt_text(text: str) -> tuple[str, str | list[int]]:
    return ("text", text)


def _prompt_ids(text: str) -> tuple[str, str | list[int]]:
    parts = [p for p in re.split(r"[,\s]+", text.strip()) if p]
    if not parts or not all(p.isdigit() for p in parts):
        raise argparse.ArgumentTypeError(
            f"--prompt-ids={text!r} is not a list of token ids; write e.g. --prompt-ids 1,2,3"
        )
    return ("ids", [int(p) for p in parts])


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "generate",
        help="generate from a local Hugging Face checkpoint, streaming tokens",
        description="Loads MODEL_DIR (config.json + *.safetensors) into the reference engine and "
        "streams the continuation of each prompt: text when a tokenizer can be read from the "
        "directory (tokenizer.json, read by transformers or tokenizers: "
        f"{install_hint('hf', 'kvstack generate ...')}), else token ids. --prompt is text "
        "(it needs the tokenizer); --prompt-ids gives token ids. Requests run in the order given.",
    )
    p.add_argument("model_dir", metavar="MODEL_DIR", type=Path)
    p.add_argument(
        "--prompt", action="append", dest="prompts", type=_prompt_text, metavar="TEXT",
        help="a text prompt, encoded by the directory's tokenizer (repeat for a batch)",
    )  # fmt: skip
    p.add_argument(
        "--prompt-ids", action="append", dest="prompts", type=_prompt_ids, metavar="IDS",
        help="a prompt as token ids, e.g. 1,2,3 (repeat for a batch)",
    )  # fmt: skip
    p.add_argument(
        "--max-new-tokens", type=count_arg("--max-new-tokens"), default=32, help="tokens per prompt"
    )
    p.add_argument("--temperature", type=_temperature, default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=count_arg("--top-k", minimum=0), default=0, help="0 = off")
    p.add_argument("--top-p", type=_top_p, default=1.0, help="1.0 = off")
    p.add_argument(
        "--seed", type=_seed, default=0, help="seed of each request's sampler, in [0, 2^64 - 1]"
    )
    p.add_argument("--ignore-eos", action="store_true", help="do not stop at the model's EOS")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    p.add_argument(
        "--dtype",
        default="auto",
        choices=_DTYPES,
        help="weights and activations; auto: the checkpoint's dtype (config.json dtype / "
        "torch_dtype), except float32 on the CPU and bfloat16 for a float32 checkpoint on a GPU "
        "(as vLLM); the choice is printed",
    )
    p.add_argument("--kv-cache-memory", type=bytes_arg, default="64MiB", help="KV pool bytes")
    p.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=KV_CACHE_DTYPES,
        help="what the KV cache stores: auto (the model dtype) or fp8 (= fp8_e4m3) / fp8_e5m2, "
        "per-tensor scales of 1.0 as vLLM's; fp8 halves a 16-bit cache, served by backends "
        "that declare fp8_per_tensor (TORCH_SDPA on the CPU, TRITON on a GPU)",
    )
    p.add_argument(
        "--block-size", type=count_arg("--block-size"), default=16, help="tokens per KV block"
    )
    p.add_argument(
        "--max-model-len",
        type=count_arg("--max-model-len"),
        default=None,
        help="tokens per request (default: the model's max_position_embeddings; more needs "
        "--allow-long-max-model-len)",
    )
    p.add_argument(
        "--allow-long-max-model-len",
        action="store_true",
        help="accept a --max-model-len above max_position_embeddings (positions the model was "
        "not trained for: outputs may be wrong)",
    )
    p.set_defaults(func=cmd_generate)


def tokenizer_files(model_dir: Path) -> list[str]:
    """The tokenizer files ``model_dir`` holds."""
    return [f for f in TOKENIZER_FILES if (model_dir / f).is_file()]


def load_tokenizer(model_dir: Path) -> Any | None:
    """A tokenizer with ``encode``/``decode`` read from ``model_dir``, or None if there is none
    (or no library here can read it)."""
    files = tokenizer_files(model_dir)
    if not files:
        return None
    try:
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
    except Exception as e:  # the libraries' messages name no file
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ValueError(
            f"{model_dir}: cannot read its tokenizer ({', '.join(files)}): {first}; fix or "
            "re-download those files, or move them away and use --prompt-ids"
        ) from None


def _encode(tok: Any, text: str) -> list[int]:
    ids = tok.encode(text)
    return list(ids.ids if hasattr(ids, "ids") else ids)


def choose_dtype(requested: str, checkpoint: str | None, device_type: str) -> tuple[str, str]:
    """``(dtype, why)`` for ``--dtype requested``: ``auto`` follows the checkpoint (vLLM's rule:
    its dtype, a float32 checkpoint in bfloat16 on a GPU); on the CPU auto computes in float32,
    where the torch reference path is fastest and exact."""
    if requested != "auto":
        return requested, "--dtype"
    ckpt = checkpoint or "not named in config.json"
    if device_type == "cpu":
        if checkpoint in (None, "float32"):
            return "float32", f"auto: checkpoint {ckpt}"
        return "float32", (
            f"auto: checkpoint {ckpt}, computed in float32 on the CPU; "
            f"--dtype {checkpoint} keeps the checkpoint's"
        )
    if checkpoint in ("bfloat16", "float16"):
        return checkpoint, f"auto: checkpoint {ckpt}"
    return "bfloat16", f"auto: checkpoint {ckpt}, bfloat16 on a GPU; --dtype float32 keeps float32"


def _check_device(text: str) -> Any:
    import torch

    try:
        device = torch.device(text)
    except RuntimeError:
        raise ValueError(f"--device={text!r} is not a device; use cpu, cuda or cuda:N") from None
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"--device={text!r}: the engine runs on cpu or cuda; use one of them")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(
                f"--device={text!r} but no CUDA GPU is visible here (torch.cuda.is_available() "
                "is False); use --device cpu"
            )
        count = torch.cuda.device_count()
        if device.index is not None and device.index >= count:
            raise ValueError(
                f"--device={text!r} but this machine has {count} CUDA GPU(s) (cuda:0 to "
                f"cuda:{count - 1}); pick one of them"
            )
    return device


def _prompts(args: argparse.Namespace, tok: Any, vocab: int) -> list[list[int]]:
    where = str(args.model_dir)
    out: list[list[int]] = []
    for kind, value in args.prompts or []:
        if kind == "ids":
            bad = [t for t in value if t >= vocab]
            if bad:
                raise ValueError(
                    f"--prompt-ids: token ids {bad[:5]} are outside {where}'s vocabulary "
                    f"[0, {vocab}); give ids below {vocab}"
                )
            out.append(list(value))
            continue
        if tok is None:
            files = tokenizer_files(args.model_dir)
            why = (
                f"{where} has {', '.join(files)} but neither transformers nor tokenizers is "
                f"installed to read it ({install_hint('hf', 'kvstack generate ...')})"
                if files
                else f"{where} has no tokenizer ({' / '.join(TOKENIZER_FILES)})"
            )
            raise ValueError(
                f"--prompt={value[:40]!r} needs a tokenizer: {why}; or give token ids with "
                "--prompt-ids 1,2,3"
            )
        out.append(_encode(tok, value))
    if not out:
        raise ValueError("give at least one --prompt TEXT or --prompt-ids 1,2,3")
    return out


def cmd_generate(args: argparse.Namespace, console: Console) -> int:
    if not (args.model_dir / "config.json").is_file():
        what = "does not exist" if not args.model_dir.exists() else "has no config.json"
        raise ValueError(
            f"MODEL_DIR {str(args.model_dir)!r} {what}; give a Hugging Face checkpoint directory "
            "(config.json + *.safetensors), e.g. one written by kvstack demo --keep DIR"
        )
    device = _check_device(args.device)
    import torch

    from kvstack.engine.engine import LLMEngine
    from kvstack.engine.hf_config import checkpoint_dtype, load_arch_config, read_json_object
    from kvstack.engine.sampling import SamplingParams

    try:
        params = SamplingParams(
            max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
            top_p=args.top_p, seed=args.seed, ignore_eos=args.ignore_eos,
        )  # fmt: skip
    except (TypeError, ValueError) as e:  # the engine's checks, named as the user wrote them
        raise ValueError(_as_flags(str(e))) from None
    arch = load_arch_config(args.model_dir)
    mpe = arch.max_position_embeddings
    if args.max_model_len is not None and args.max_model_len > mpe:
        if not args.allow_long_max_model_len:
            raise ValueError(
                f"--max-model-len={args.max_model_len} is above the model's "
                f"max_position_embeddings={mpe} (config.json); give at most {mpe}, or pass "
                "--allow-long-max-model-len to run positions the model was not trained for"
            )
        sys.stderr.write(
            f"warning: --max-model-len={args.max_model_len} is above max_position_embeddings="
            f"{mpe} (--allow-long-max-model-len): outputs past {mpe} tokens may be wrong\n"
        )
    tok = load_tokenizer(args.model_dir)
    prompts = _prompts(args, tok, arch.vocab_size)
    if tok is None and tokenizer_files(args.model_dir):
        sys.stderr.write(
            f"note: {args.model_dir} has a tokenizer but no library here reads it, so output is "
            f"token ids; for text: {install_hint('hf', 'kvstack generate ...')}\n"
        )
    ckpt_dtype = checkpoint_dtype(read_json_object(args.model_dir / "config.json"))
    dtype, why = choose_dtype(args.dtype, ckpt_dtype, device.type)
    sys.stderr.write(f"dtype: {dtype} ({why})\n")
    engine = LLMEngine(
        args.model_dir, device=device, dtype=getattr(torch, dtype),
        kv_cache_memory=args.kv_cache_memory, block_size=args.block_size,
        max_model_len=args.max_model_len, max_num_seqs=max(1, len(prompts)),
        allow_long_max_model_len=args.allow_long_max_model_len,
        kv_cache_dtype=args.kv_cache_dtype,
    )  # fmt: skip
    if engine.runner.kv_cache_dtype.quantized:
        sys.stderr.write(f"kv cache: {engine.runner.kv_cache_dtype}\n")
    out = sys.stdout
    several = len(prompts) > 1
    outputs: dict[str, list[int]] = {}
    for ev in engine.stream(prompts, params):
        toks = outputs.setdefault(ev.request_id, [])
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
    else:  # the streamed lines interleave requests: each one's whole output, in prompt order
        out.write("\n")
        for rid in (str(i) for i in range(len(prompts))):  # stream's request ids
            toks = outputs.get(rid, [])
            text = " ".join(map(str, toks)) if tok is None else tok.decode(toks)
            out.write(f"[{rid}] {text}\n")
    st = engine.stats()
    sys.stderr.write(
        f"{st.num_generated_tokens} tokens in {st.wall_seconds:.2f} s "
        f"({st.tokens_per_second:,.1f} tokens/s); prefix-cache hit rate {st.scheduler.prefix_hit_rate:.0%}\n"
    )
    return 0


def _as_flags(message: str) -> str:
    """``SamplingParams.top_p=...`` -> ``--top-p=...``: errors name the flag the user typed."""
    return re.sub(r"SamplingParams\.(\w+)", lambda m: "--" + m.group(1).replace("_", "-"), message)
