"""A frozen base stored quantised: NF4 blocks (4-bit codes, per-block scales), sharded on whole blocks."""
