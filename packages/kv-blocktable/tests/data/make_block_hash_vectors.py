"""Regenerate block_hash_vectors.json (run from the repo root; needs xxhash for the xxhash128 rows).

    .venv/bin/python packages/kv-blocktable/tests/data/make_block_hash_vectors.py

The vectors pin encoding version 1 (docs/block_hash.md). Changing them means a new encoding
version: every external indexer's hashes change with it.
"""

from __future__ import annotations

import json
from pathlib import Path

from kv_blocktable import HASH_ENCODING_VERSION, encode_block, hash_block_tokens

OUT = Path(__file__).with_name("block_hash_vectors.json")

CASES: list[dict[str, object]] = [
    {"name": "first block, 4 tokens", "tokens": [1, 2, 3, 4], "extra_keys": []},
    {"name": "first block, 16 tokens", "tokens": list(range(100, 116)), "extra_keys": []},
    {"name": "one token", "tokens": [0], "extra_keys": []},
    {"name": "int64 extremes", "tokens": [-(2**63), 2**63 - 1, -1, 2**32], "extra_keys": []},
    {
        "name": "salt and lora",
        "tokens": [1, 2, 3, 4],
        "extra_keys": [["cache_salt", "tenant-a"], ["lora_name", "sql-adapter"]],
    },
    {"name": "multimodal, utf-8", "tokens": [9, 9, 9, 9], "extra_keys": [["mm_hash", "ä猫-img-0"]]},
]


def main() -> None:
    rows = []
    for algo in ("sha256", "xxhash128"):
        for case in CASES:
            extra = tuple(tuple(kv) for kv in case["extra_keys"])  # type: ignore[attr-defined]
            tokens = case["tokens"]
            first = hash_block_tokens(None, tokens, extra, algo=algo)  # type: ignore[arg-type]
            rows.append(
                {
                    "algo": algo,
                    "name": case["name"],
                    "parent_hash": None,
                    "token_ids": tokens,
                    "extra_keys": case["extra_keys"],
                    "message": encode_block(None, tokens, extra).hex(),  # type: ignore[arg-type]
                    "digest": first.hex(),
                }
            )
        # A chain: block 2 of [1..4][5..8] with its parent.
        parent = hash_block_tokens(None, [1, 2, 3, 4], algo=algo)
        rows.append(
            {
                "algo": algo,
                "name": "second block of a chain (parent = 'first block, 4 tokens')",
                "parent_hash": parent.hex(),
                "token_ids": [5, 6, 7, 8],
                "extra_keys": [],
                "message": encode_block(parent, [5, 6, 7, 8]).hex(),
                "digest": hash_block_tokens(parent, [5, 6, 7, 8], algo=algo).hex(),
            }
        )
    OUT.write_text(
        json.dumps({"encoding_version": HASH_ENCODING_VERSION, "vectors": rows}, indent=1) + "\n"
    )
    print(f"wrote {len(rows)} vectors to {OUT}")


if __name__ == "__main__":
    main()
