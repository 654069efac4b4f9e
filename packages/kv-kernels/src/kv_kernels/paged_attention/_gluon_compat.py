"""The Gluon names that differ between the triton versions kv-kernels supports (3.6, the GPU
machine's, and 3.9, the lock's), for every sm_90 Gluon kernel: one place to mend when they move."""

from __future__ import annotations

from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import tma

__all__ = ["async_load", "barrier", "tma_load"]

#: ``cp.async`` of a tensor of pointers into shared memory: 3.9's ``async_load``, 3.6's
#: ``async_copy_global_to_shared``
async_load = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared
#: a barrier of the partition's warps (the CTA's outside warp specialization): 3.9's ``barrier``,
#: 3.6's ``thread_barrier``
barrier = getattr(gl, "barrier", None) or gl.thread_barrier
#: a TMA copy of a descriptor's box into shared memory, completing on an mbarrier: 3.9's
#: ``tma.async_load``, 3.6's ``tma.async_copy_global_to_shared``
tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
