"""The last built step of :class:`~kv_blocktable.block_table.BlockTables`, exported: its token
positions, and its tables in the forms other kernel families read (FlashInfer-style CSR pages,
FlexAttention's physical -> logical block map). A base class of ``BlockTables``, split out of
``block_table.py`` by job: these read the step the tables built, they change nothing."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kv_blocktable import attn_metadata as _md

if TYPE_CHECKING:
    from kv_blocktable.attn_metadata import KeyWindow

__all__ = ["StepExports"]


class StepExports:
    """Exports of the last step :meth:`BlockTables.build_common_metadata` built."""

    # Set by BlockTables (declared here for the type checker).
    _positions: torch.Tensor | None
    _last_step: _md.StepInputs | None
    _kernel: tuple[torch.Tensor, ...]
    num_blocks: int | None
    null_block: int | None
    key_windows: tuple[KeyWindow | None, ...]
    kernel_block_sizes: tuple[int, ...]

    if TYPE_CHECKING:  # BlockTables' own, which these exports call

        @property
        def kernel_blocks_per_block(self) -> tuple[int, ...]: ...

        def _check_group(self, group: object) -> int: ...

        def _require_committed(self, num_reqs: int, what: str) -> None: ...

    @property
    def positions(self) -> torch.Tensor:
        """int64 ``[T]`` positions of the last built step's tokens, on the tables' device (a
        persistent buffer's view, overwritten by the next :meth:`build_common_metadata`)."""
        if self._positions is None:
            raise ValueError("positions are the last step's; call build_common_metadata first")
        return self._positions

    # -- exports for other kernel families ---------------------------------------------------

    def _exported_step(self, what: str) -> _md.StepInputs:
        if self._last_step is None:
            raise ValueError(
                f"{what} exports the last step's batch; call build_common_metadata first"
            )
        self._require_committed(self._last_step.num_reqs, what)
        return self._last_step

    def csr(self, group: int) -> _md.PagedKVIndices:
        """FlashInfer-style pages of the last built step for ``group`` (kernel blocks, int32):
        ``indptr`` ``[R + 1]``, ``indices`` ``[indptr[-1]]``, ``last_page_len`` ``[R]``."""
        self._check_group(group)
        step = self._exported_step("csr")
        return _md.csr_from_table(
            self._kernel[group][: step.num_reqs], step.seq_lens, self.kernel_block_sizes[group]
        )

    def flex_physical_to_logical(self, group: int) -> torch.Tensor:
        """FlexAttention's map for the last built step: int32 ``[num_blocks * k]``, the logical
        kernel-block column of each physical kernel block a request of the batch reads, ``-1``
        for the rest (null blocks and blocks before a request's key window included). Raises
        when a block sits at two positions."""
        self._check_group(group)
        if self.num_blocks is None:
            raise ValueError(
                "flex_physical_to_logical needs num_blocks; build BlockTables with num_blocks= "
                "(from_config passes it)"
            )
        step = self._exported_step("flex_physical_to_logical")
        k = self.kernel_blocks_per_block[group]
        window = self.key_windows[group]
        first_query = step.seq_lens - step.query_lens  # [R] position of each first new token
        return _md.physical_to_logical(
            self._kernel[group][: step.num_reqs],
            step.seq_lens,
            self.kernel_block_sizes[group],
            num_kernel_blocks=self.num_blocks * k,
            null_kernel_blocks=None if self.null_block is None else (self.null_block * k, k),
            first_pos=None if window is None else window.first_visible(first_query),
        )
