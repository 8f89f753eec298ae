"""Dedicated ownership: which rank owns each Muon-target matrix, and the hooks that move it."""
