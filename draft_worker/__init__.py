"""Draft worker: pluggable drafters (ngram, draft_model) proposing k tokens per round."""
