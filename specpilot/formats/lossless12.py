"""Lossless 12-bit storage of bf16 weight matrices: 1.5 bytes a weight instead of 2, every weight restored exactly.

Why: a bs-1 decode step reads every weight once, so its floor is bytes / bandwidth. A bf16 weight is 16 bits, but
its top byte (sign + the exponent's 7 high bits) takes few values in a trained (or randomly initialised) matrix:
the magnitudes of a matrix span ~14 binades, i.e. ~7 values of that byte. Storing that byte as a 4-bit code
(sign + a 3-bit index into an 8-entry table of magnitudes) next to the untouched low byte (the exponent's last bit
+ the 7 mantissa bits) reads 12 bits a weight; the rare weights whose magnitude byte is not in the table are kept
exactly in a short per-row list (measured: 1.6e-4 of Qwen2.5-Coder-1.5B's weights, 8e-5 of N(0, 0.02) ones).
The GEMV kernel (kernels/gemv12.py) rebuilds each weight's bf16 bits in registers, so the weights stay exact and
only the GEMV's fp32 summation order differs from a bf16 kernel's (as any two kernels' do).

Layout of a matrix W [N, K] (K a multiple of 8), a `Packed12`:
  lo     uint8 [N, K]    the bf16 low bytes (exponent bit 0 + mantissa), in place
  codes  uint8 [N, K/2]  each weight's magnitude index (3 bits, into `table`) and sign, for column pairs
                         (j, K/2 + j): the first and second half of the row side by side; four pairs j = 4g..4g+3
                         share one little-endian 32-bit word:
                           bits 4k..4k+2       index of column 4g + k          (k = 0..3)
                           bits 16+4k..18+4k   index of column K/2 + 4g + k
                           bit 8k + 7          sign of column 4g + k
                           bit 8k + 3          sign of column K/2 + 4g + k
  table  uint8 [8]       magnitude bytes (bf16 bits 14..8); entry 0 is always 0 (zero and the tiniest values)
  exc_ptr int32 [N + 1], exc_col int32 [E], exc_val fp32 [E]: the exceptions of row n are
                         exc_col/exc_val[exc_ptr[n]:exc_ptr[n + 1]]; their codes decode to +0, so the GEMV adds
                         exc_val * x[col] to the row (exact: bf16 -> fp32 is exact).
Why this word: the kernel decodes four weights of a row half with ~10 GPU instructions. The four 3-bit indices sit
in nibbles, so `and 0x7777` makes them a byte-permute selector that looks the four magnitudes up in the table held
in two registers; the four signs sit at the byte tops, so one `and 0x80808080` puts them in place; the second
half's take one shift more. And the halves keep every load contiguous: x[j] and x[K/2 + j], lo[j] and lo[K/2 + j].
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specpilot.errors import ConfigError

TABLE_SIZE = 8


@dataclass
class Packed12:
    """One matrix in the 12-bit layout (module docstring); `shape` is the original [N, K]."""

    lo: torch.Tensor
    codes: torch.Tensor
    table: torch.Tensor
    exc_ptr: torch.Tensor
    exc_col: torch.Tensor
    exc_val: torch.Tensor
    shape: tuple[int, int]
    words: tuple[int, int]  # the table as two little-endian int32 words (entries 0-3, 4-7): the kernel's byte-
    # permute operands, kept on the host so a launch never reads the table back from the device

    @property
    def num_exceptions(self) -> int:
        return int(self.exc_col.numel())

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.lo, self.codes, self.table, self.exc_ptr,
                                                            self.exc_col, self.exc_val))


def _check(w: torch.Tensor) -> None:
    if w.dtype != torch.bfloat16:
        raise ConfigError(f"lossless 12-bit weights need a bf16 matrix, got {w.dtype} (the format splits bf16 bits)")
    if w.dim() != 2 or w.shape[1] % 8 or w.numel() == 0:
        raise ConfigError(f"lossless 12-bit weights need a non-empty [N, K] matrix with K a multiple of 8, got "
                          f"{tuple(w.shape)}")


def _bits(w: torch.Tensor) -> torch.Tensor:
    return w.contiguous().view(torch.int16).to(torch.int32) & 0xFFFF


def pack(w: torch.Tensor) -> Packed12:
    """bf16 W [N, K] -> Packed12 (on W's device); `unpack(pack(w))` equals W bit for bit."""
    _check(w)
    n, k = w.shape
    bits = _bits(w)
    mag = (bits >> 8) & 0x7F
    counts = torch.bincount(mag.flatten(), minlength=128)
    counts[0] = -1  # entry 0 is fixed to magnitude 0: pick the 7 most frequent others
    top = torch.argsort(counts, descending=True, stable=True)[: TABLE_SIZE - 1]
    top = top[counts[top] > 0].sort().values
    table = torch.zeros(TABLE_SIZE, dtype=torch.int32, device=w.device)
    table[1:1 + top.numel()] = top.to(torch.int32)
    lookup = torch.full((128,), -1, dtype=torch.int32, device=w.device)  # magnitude -> index, -1: exception
    lookup[table] = torch.arange(TABLE_SIZE, dtype=torch.int32, device=w.device)
    idx = lookup[mag]
    exc = idx < 0
    sign = (bits >> 15) & 1
    lo = bits & 0xFF
    code = (sign << 3) | idx.clamp_min(0)
    code = torch.where(exc, torch.zeros_like(code), code)  # exceptions decode to +0 ...
    lo = torch.where(exc, torch.zeros_like(lo), lo)
    rows, cols = exc.nonzero(as_tuple=True)  # ... and their values live in the row lists (row-major order)
    exc_val = (bits[rows, cols] << 16).view(torch.float32)  # bf16 -> fp32 by its bits (NaN payloads too)
    exc_ptr = torch.zeros(n + 1, dtype=torch.int32, device=w.device)
    exc_ptr[1:] = torch.cumsum(torch.bincount(rows, minlength=n), 0).to(torch.int32)
    lo8 = lo.to(torch.uint8).contiguous()
    codes = _words(code[:, : k // 2], code[:, k // 2:])
    t = [int(v) for v in table.tolist()]
    words = tuple(_int32(sum(t[4 * w + i] << (8 * i) for i in range(4))) for w in range(2))
    return Packed12(lo8, codes, table.to(torch.uint8), exc_ptr, cols.to(torch.int32).contiguous(),
                    exc_val.contiguous(), (n, k), words)


def _int32(word: int) -> int:
    return word - (1 << 32) if word >= 1 << 31 else word  # as a signed int32 kernel argument


_K = torch.arange(4)


def _words(first: torch.Tensor, second: torch.Tensor) -> torch.Tensor:
    """Codes (sign << 3 | index, int32) of the two row halves [N, K/2] -> the code words as uint8 [N, K/2]."""
    n, h = first.shape
    a, b = first.reshape(n, h // 4, 4), second.reshape(n, h // 4, 4)
    k = _K.to(first.device)
    word = (((a & 7) << (4 * k)) | ((b & 7) << (16 + 4 * k)) | ((a >> 3) << (8 * k + 7))
            | ((b >> 3) << (8 * k + 3))).sum(-1, dtype=torch.int64)  # disjoint bits: the sum is the OR
    word = torch.where(word >= 1 << 31, word - (1 << 32), word).to(torch.int32)
    return word.contiguous().view(torch.uint8).reshape(n, h)  # little-endian bytes


def _codes(codes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of _words: uint8 [N, K/2] -> the two halves' codes (sign << 3 | index), int32 [N, K/2] each."""
    n, h = codes.shape
    word = codes.contiguous().view(torch.int32).reshape(n, h // 4, 1).to(torch.int64) & 0xFFFFFFFF
    k = _K.to(codes.device)
    a = ((word >> (4 * k)) & 7) | (((word >> (8 * k + 7)) & 1) << 3)
    b = ((word >> (16 + 4 * k)) & 7) | (((word >> (8 * k + 3)) & 1) << 3)
    return a.reshape(n, h).to(torch.int32), b.reshape(n, h).to(torch.int32)


def unpack(p: Packed12) -> torch.Tensor:
    """Packed12 -> the bf16 matrix, exactly (the reference the kernel's decoding is tested against)."""
    n, k = p.shape
    lo = p.lo.to(torch.int32)
    code = torch.cat(_codes(p.codes), dim=1)
    hi = p.table.to(torch.int32)[code & 7] | ((code >> 3) << 7)
    bits = (hi << 8) | lo
    w = (bits - ((bits >> 15) << 16)).to(torch.int16).view(torch.bfloat16).clone()  # uint16 -> int16 range
    if p.num_exceptions:
        rows = torch.repeat_interleave(torch.arange(n, device=w.device), (p.exc_ptr[1:] - p.exc_ptr[:-1]).long())
        hi16 = p.exc_val.view(torch.int32) >> 16  # fp32 bits -> the bf16 bits (arithmetic shift: int16 range)
        w[rows, p.exc_col.long()] = hi16.to(torch.int16).view(torch.bfloat16)
    return w


def bytes_per_weight(p: Packed12) -> float:
    """Stored bytes / weights (1.5 plus the tables and exception lists)."""
    return p.nbytes() / (p.shape[0] * p.shape[1])
