"""Drafter training: data (ShareGPT prompts, target-regenerated responses, cached
target features), the block-drafter trainer and the offline acceptance evaluation."""
