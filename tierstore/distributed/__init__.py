"""Sharded tiered tables over torch.distributed: row- and table-wise plans, collective steps.

Each rank owns a local TierStore for its shard; ids go to their owners and pooled bags (or
row-wise partial sums) come back by all-to-all; gradients go back to the owners, which run the
fused optimizer. See docs/distributed.md.
"""

from .errors import DistributedError, RankFailureError
from .module import ShardedEmbeddingBagCollection
from .plan import ShardingPlan, TablePlacement, make_plan, row_owner
from .store import ShardedTierStore, read_sharded_manifest, shard_dir

__all__ = [
    "ShardedTierStore", "ShardedEmbeddingBagCollection", "ShardingPlan", "TablePlacement",
    "make_plan", "row_owner", "DistributedError", "RankFailureError", "read_sharded_manifest",
    "shard_dir",
]
