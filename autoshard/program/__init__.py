"""A Plan lowered to the per-rank forward/backward FX programs: redistributions, buckets."""
