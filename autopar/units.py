"""Units and the constants more than one layer reads: byte units, and the sizes of the programs' gradient buckets.

A bottom-layer module: it imports nothing from autopar, so the cost model, the solvers and the runtime all read it.

Gradient buckets are priced and run at one size, DDP's default, under two names: `BUCKET_BYTES` is what the
programs pack their gradients into (`runtime.overlap`, `runtime.data_parallel`, `runtime.base.sum_in_buckets`),
`PRICED_BUCKET_BYTES` what the sharding solver prices a plan's buckets at. Distributed tests shrink the runtime's
buckets to get several of them in a tiny model (they rebind `runtime.overlap.BUCKET_BYTES`), and pricing tests
shrink the priced ones, each without moving the other.
"""

from __future__ import annotations

KIB = 2**10
MIB = 2**20
GIB = 2**30

# AdamW steps fp32 weights: the parameters in fp32 training, their master copy in mixed precision
FP32_BYTES = 4

BUCKET_BYTES = 25 * MIB  # a gradient bucket as the programs make them (DDP's default size)
PRICED_BUCKET_BYTES = BUCKET_BYTES  # a gradient bucket as the solver prices it (see the module docstring)
# reduce-scatter buckets a ZeRO-2/3 program has in flight at once (it waits for the oldest before it launches
# another): what bounds the send buffers a plan prices
BUCKETS_IN_FLIGHT = 2
