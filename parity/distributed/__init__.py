"""Models past one process: capture and compare under torch.distributed, across parallel layouts.

- :mod:`parity.distributed.placement`: where a recorded tensor lives on a 1-D device mesh (``Shard(dim)``,
  ``Replicate``, ``Partial(sum)``), how it is read off a DTensor, a parallelize plan or a user's
  placement map, and how the full tensor is rebuilt from the ranks' shards.
- :mod:`parity.distributed.group`: the process group and mesh of a run, and agreeing on errors across ranks.
- :mod:`parity.distributed.rankset`: a rank set on disk (one bundle per rank plus a top manifest, committed
  as a whole) and the views that judge one: full tensors rebuilt, or one rank's bundle.
- :mod:`parity.distributed.capture`: every rank records its shards into its bundle; rank 0 commits the set.
- :mod:`parity.distributed.compare`: judge a rank set against a run or another set of any world size.

Nothing here is imported by ``import parity``; torch.distributed is imported on first use.
"""
