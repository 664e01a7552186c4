"""GPU and batch-size allocation across jobs: the exact DP allocator and the scheduling policies on top."""
from elasticlab.alloc.dp import allocation_value, dp_allocate, dp_allocate_reference, is_concave_row

__all__ = ["dp_allocate", "dp_allocate_reference", "allocation_value", "is_concave_row"]
