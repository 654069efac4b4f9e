"""One module per architecture, one registry that everything reads.

Each module declares :class:`ArchFamily` values: the ``architectures`` names of ``config.json``
it serves, ``parse`` (its config fields -> :class:`~kvstack.engine.hf_config.ArchConfig`
switches, refusing what it cannot honour by name), a tiny transformers config for the parity tests
and the checks that keep that config meaningful, and checkpoint renames. ``hf_config`` (the
supported architectures), the loader (renames) and the tests (parametrized over
:data:`FAMILIES`) read :data:`FAMILIES` and nothing else, so adding a family is one module here
plus its entry below. The layer pieces a family needs live in :mod:`kvstack.engine.layers` and
:mod:`kvstack.engine.models`, switched by the parsed config.
"""

from __future__ import annotations

from collections.abc import Mapping

from kvstack.engine.archs._base import ArchFamily
from kvstack.engine.archs.deepseek_v3 import DEEPSEEK_V3
from kvstack.engine.archs.gemma import GEMMA2, GEMMA3
from kvstack.engine.archs.gpt_oss import GPT_OSS
from kvstack.engine.archs.llama import LLAMA, MISTRAL, QWEN2, QWEN3
from kvstack.engine.archs.mimo_v2_flash import MIMO_V2_FLASH
from kvstack.engine.archs.mixtral import MIXTRAL
from kvstack.engine.archs.qwen3_moe import QWEN3_MOE

__all__ = ["ARCHITECTURES", "FAMILIES", "ArchFamily", "family_of"]

#: Every served family by name, in the order the docs and tests list them.
FAMILIES: Mapping[str, ArchFamily] = {
    f.name: f
    for f in (
        LLAMA,
        QWEN3,
        MISTRAL,
        GPT_OSS,
        QWEN2,
        MIXTRAL,
        QWEN3_MOE,
        GEMMA2,
        GEMMA3,
        MIMO_V2_FLASH,
        DEEPSEEK_V3,
    )
}

#: ``config.json`` ``architectures[0]`` -> its family.
ARCHITECTURES: Mapping[str, ArchFamily] = {a: f for f in FAMILIES.values() for a in f.architectures}


def family_of(architecture: str) -> ArchFamily:
    """The family serving ``architecture``; ``ValueError`` listing the served ones."""
    family = ARCHITECTURES.get(architecture)
    if family is None:
        raise ValueError(
            f"config.json architectures=[{architecture!r}] is not supported; the engine serves "
            f"exactly one of {sorted(ARCHITECTURES)}"
        )
    return family
