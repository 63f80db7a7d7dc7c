"""Intra-op sharding: one integer program per (dp, tp) mesh, and the search over meshes that picks the plan."""
