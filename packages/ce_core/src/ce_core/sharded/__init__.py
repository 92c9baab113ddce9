"""Placement and collectives: how a call is laid out over devices, and what one shard computes."""
