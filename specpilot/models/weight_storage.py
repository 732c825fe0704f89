"""Low-precision *storage* of weight matrices: int8 or int4, symmetric, one fp16 scale per group of inputs.

Why: a shipped drafter must be small (it travels in the repository), and a drafter's precision can never
change what speculative decoding outputs (the target verifies every token); it only moves tau a little. So
drafters are stored in int8/int4 and dequantized to the compute dtype when loaded: compute stays bf16.

A matrix W [out, in] with groups of g inputs (g divides in) is stored as
  `q`     int8 [out, in] (int8) or uint8 [out, in / 2] (int4: two 4-bit codes per byte, low nibble first)
  `scale` fp16 [out, in / g], scale = max|W[group]| / qmax (qmax 127 or 7), codes = round(W / scale)
and W' = codes * scale. int4 codes are kept in [-7, 7] (stored +8, so 1..15) to stay symmetric.
"""

from __future__ import annotations

import torch

from specpilot.errors import ConfigError, ModelFormatError

FORMATS = {"int8": 127, "int4": 7}


def check_format(fmt: str, group_size: int) -> None:
    if fmt not in FORMATS:
        raise ConfigError(f"storage format must be one of {sorted(FORMATS)} (or a float dtype), got {fmt!r}")
    if group_size <= 0:
        raise ConfigError(f"group size must be > 0, got {group_size}")


def quantize(w: torch.Tensor, fmt: str, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """W [out, in] -> (codes, fp16 scales) as described in the module docstring."""
    check_format(fmt, group_size)
    if w.dim() != 2:
        raise ConfigError(f"only matrices are quantized, got shape {tuple(w.shape)}")
    out_f, in_f = w.shape
    g = min(group_size, in_f)
    if in_f % g or (fmt == "int4" and in_f % 2):
        raise ConfigError(f"input size {in_f} is not a multiple of the group size {g} (int4 also needs it even)")
    qmax = FORMATS[fmt]
    wf = w.detach().float().reshape(out_f, in_f // g, g)
    scale = (wf.abs().amax(-1) / qmax).to(torch.float16).float()
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # all-zero group: any scale reproduces it
    codes = torch.round(wf / scale[..., None]).clamp_(-qmax, qmax).to(torch.int8).reshape(out_f, in_f)
    if fmt == "int4":
        u = (codes + 8).to(torch.uint8)
        codes = u[:, 0::2] | (u[:, 1::2] << 4)
    return codes.contiguous(), scale.to(torch.float16).contiguous()


def dequantize(codes: torch.Tensor, scale: torch.Tensor, fmt: str, dtype=torch.float32) -> torch.Tensor:
    """(codes, scales) from `quantize` -> W' [out, in] in `dtype`."""
    check_format(fmt, 1)
    if fmt == "int4":
        if codes.dtype != torch.uint8:
            raise ModelFormatError(f"int4 codes must be uint8, got {codes.dtype}")
        lo = (codes & 0xF).to(torch.int16) - 8
        hi = (codes >> 4).to(torch.int16) - 8
        vals = torch.stack([lo, hi], dim=-1).reshape(codes.shape[0], codes.shape[1] * 2)
    else:
        if codes.dtype != torch.int8:
            raise ModelFormatError(f"int8 codes must be int8, got {codes.dtype}")
        vals = codes.to(torch.int16)
    out_f, in_f = vals.shape
    groups = scale.shape[-1]
    if scale.shape[0] != out_f or groups == 0 or in_f % groups:
        raise ModelFormatError(f"scales {tuple(scale.shape)} do not fit codes of a [{out_f}, {in_f}] matrix")
    w = vals.float().reshape(out_f, groups, in_f // groups) * scale.float()[..., None]
    return w.reshape(out_f, in_f).to(dtype)
