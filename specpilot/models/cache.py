"""The preallocated KV cache: one pool for all layers, written in place, never grown or copied.

Invariant: slot `p` of a row holds the key/value of the token at position `p`. Rolling back rejected draft
tokens therefore needs no tensor work at all: the caller just forgets them, the causal mask (key position <=
query position) hides stale slots, and the next write at those positions overwrites them.
"""

from __future__ import annotations

import torch

from specpilot.models.config import ModelConfig


class KVCache(torch.nn.Module):
    def __init__(self, cfg: ModelConfig, batch_size: int, max_seq_len: int, *, dtype: torch.dtype, device="cpu"):
        super().__init__()
        shape = (cfg.num_hidden_layers, batch_size, cfg.num_key_value_heads, max_seq_len, cfg.head_dim)
        self.register_buffer("k", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.max_seq_len = max_seq_len
        self.batch_size = batch_size

    def rows(self, n: int) -> "KVCache":
        """A cache over this pool's first `n` batch rows: views, so its writes land here and its tensors keep their
        addresses (a CUDA graph captured on it stays valid while this pool lives; engine/batch.py)."""
        view = KVCache.__new__(KVCache)
        torch.nn.Module.__init__(view)
        view.register_buffer("k", self.k[:, :n], persistent=False)
        view.register_buffer("v", self.v[:, :n], persistent=False)
        view.max_seq_len, view.batch_size = self.max_seq_len, n
        return view

    def write(self, layer: int, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        # positions [B, T]; k, v [B, Hkv, T, D]
        if positions.shape[0] == 1:  # one row: a plain index_copy keeps the common case cheap
            self.k[layer].index_copy_(2, positions[0], k)
            self.v[layer].index_copy_(2, positions[0], v)
        else:
            rows = torch.arange(positions.shape[0], device=positions.device)[:, None]
            self.k[layer][rows, :, positions] = k.transpose(1, 2)
            self.v[layer][rows, :, positions] = v.transpose(1, 2)

    def read(self, layer: int, kv_len: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        # -> k, v [B, Hkv, S, D] with S = kv_len (a host int on the eager path) or the whole pool (graphs)
        if kv_len is None:
            return self.k[layer], self.v[layer]
        return self.k[layer, :, :, :kv_len], self.v[layer, :, :, :kv_len]
