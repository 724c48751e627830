"""Sharded tiered tables over torch.distributed: row-, table-, column-wise, data-parallel.

Each rank owns a local TierStore for its shard; ids go to their owners and pooled bags (or
row-wise partial sums) come back by all-to-all; gradients go back to the owners, which run the
fused optimizer. See docs/distributed.md.
"""

from .errors import DistributedError, RankFailureError
from .module import ShardedEmbeddingBagCollection
from .plan import ShardingPlan, TablePlacement, make_plan, row_owner
from .planner import CostModel, auto_plan, lookups_from_batches
from .store import ShardedTierStore, read_sharded_manifest, shard_dir

__all__ = [
    "ShardedTierStore", "ShardedEmbeddingBagCollection", "ShardingPlan", "TablePlacement",
    "make_plan", "row_owner", "DistributedError", "RankFailureError", "read_sharded_manifest",
    "shard_dir", "CostModel", "auto_plan", "lookups_from_batches",
]
