"""Target-side context features for the block drafter.

Hugging Face ``output_hidden_states=True`` on a llama model returns a tuple of
``num_hidden_layers + 1`` tensors, each ``[batch, T, H]``:

* ``hidden_states[0]``      – the token embeddings (input of decoder layer 0);
* ``hidden_states[i + 1]``  – the output (residual stream) of decoder layer ``i``
  for ``i = 0 .. num_hidden_layers - 2``;
* ``hidden_states[-1]``     – the output of the LAST decoder layer *after* the final
  RMSNorm (transformers 5.x records the normed state there; checked on SmolLM2).

``target_layers`` in :class:`~specmesh.drafters.block.BlockDrafterConfig` are
0-based decoder-layer indices, so layer ``i``'s feature is ``hidden_states[i + 1]``.
A target worker that runs its own loop must return, per position, the residual
stream right after decoder layer ``i`` (pre final-norm unless ``i`` is the last layer).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def extract_target_features(hidden_states: Sequence[torch.Tensor], target_layers: Sequence[int]) -> torch.Tensor:
    """Concatenate the chosen layers' hidden states along the feature axis.

    hidden_states: tuple of (num_layers + 1) tensors, each [T, H] or [1, T, H]
    returns:       [T, len(target_layers) * H] (same dtype), layer order as given
    """
    n_layers = len(hidden_states) - 1
    picked = []
    for layer in target_layers:
        if not 0 <= layer < n_layers:
            raise ValueError(f"target layer {layer} outside 0..{n_layers - 1}")
        h = hidden_states[layer + 1]
        if h.dim() == 3:
            if h.shape[0] != 1:
                raise ValueError("extract_target_features takes one sequence; index the batch first")
            h = h[0]
        picked.append(h)
    return torch.cat(picked, dim=-1)
