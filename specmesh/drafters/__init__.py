"""Draft models used by the draft worker (block drafter with causal injection)."""
