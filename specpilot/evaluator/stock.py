"""Peer and stock systems, run from their released code (never re-implemented here):

- `hf-ar`: transformers' own `generate`, greedy, static cache — the peer AR baseline;
- `stock` with a model drafter: transformers' assisted generation (`generate(assistant_model=...)`);
- `stock` with n-gram drafting: transformers' prompt lookup (`generate(prompt_lookup_num_tokens=K)`).
Each is wrapped to return a `GenerationResult`, so the bench treats every system alike. Timing brackets the whole
`generate` call, synchronized on GPU, like ours.
"""

from __future__ import annotations

import sys
import tempfile
import time

import torch

from specpilot.engine.result import GenerationResult


class HFSystem:
    def __init__(self, target_path, *, dtype, device, max_new_tokens: int, eos_ids, assistant_path=None,
                 prompt_lookup: int = 0, static_cache: bool = True, model=None):
        from transformers import AutoModelForCausalLM

        self.device = torch.device(device)
        load = lambda p: AutoModelForCausalLM.from_pretrained(str(p), dtype=dtype).to(self.device).eval()
        self.model = model if model is not None else load(target_path)  # `model`: the same target, already loaded
        self.assistant = load(assistant_path) if assistant_path is not None else None
        self.kwargs = dict(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=list(eos_ids) or None,
                           pad_token_id=(list(eos_ids) or [0])[0])
        if self.assistant is not None:
            self.kwargs["assistant_model"] = self.assistant
        elif prompt_lookup:
            self.kwargs["prompt_lookup_num_tokens"] = prompt_lookup
        elif static_cache:
            self.kwargs["cache_implementation"] = "static"

    def _sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @torch.inference_mode()
    def generate(self, prompt_ids: list[int]) -> GenerationResult:
        ids = torch.tensor([prompt_ids], device=self.device)
        self._sync()
        t0 = time.perf_counter()
        try:
            out = self.model.generate(ids, attention_mask=torch.ones_like(ids), **self.kwargs)
        except Exception as e:  # a transformers version without this cache type: fall back to its default cache
            if self.kwargs.pop("cache_implementation", None) is None:
                raise
            print(f"hf-ar: static cache unavailable ({type(e).__name__}: {e}); using the default cache",
                  file=sys.stderr)
            out = self.model.generate(ids, attention_mask=torch.ones_like(ids), **self.kwargs)
        self._sync()
        elapsed = time.perf_counter() - t0
        new = out[0, len(prompt_ids):].tolist()
        eos = set(self.kwargs["eos_token_id"] or [])
        for i, t in enumerate(new):  # HF pads finished sequences; keep up to the first EOS, as our stop rule does
            if t in eos:
                new = new[: i + 1]
                break
        return GenerationResult(list(prompt_ids), new, "eos" if new and new[-1] in eos else "length", decode_s=elapsed)


class DFlashStockSystem:
    """z-lab's released DFlash loop (`dflash` package: `dflash_generate`, what `DFlashDraftModel.spec_generate`
    runs) over transformers' target, with the same checkpoint our engine loads."""

    def __init__(self, target_path, drafter_path, *, dtype, device, max_new_tokens: int, eos_ids, model=None):
        try:
            from dflash.model import DFlashDraftModel, dflash_generate
        except ImportError:
            from specpilot.errors import ConfigError

            raise ConfigError("stock for DFlash needs z-lab's package: pip install --no-deps dflash==0.1.0") from None
        from transformers import AutoModelForCausalLM

        self.device = torch.device(device)
        self._generate = dflash_generate
        from specpilot.models.dflash_io import export_zlab, read_storage

        self.target = model if model is not None else \
            AutoModelForCausalLM.from_pretrained(str(target_path), dtype=dtype).to(self.device).eval()
        if read_storage(drafter_path) is not None:  # SpecPilot's int8/int4 storage: z-lab reads plain floats only
            self._tmp = tempfile.TemporaryDirectory(prefix="specpilot-zlab-")
            drafter_path = export_zlab(drafter_path, self._tmp.name, str(dtype).removeprefix("torch."))
        self.draft = DFlashDraftModel.from_pretrained(str(drafter_path), dtype=dtype).to(self.device).eval()
        self.max_new_tokens, self.eos = max_new_tokens, list(eos_ids)

    @torch.inference_mode()
    def generate(self, prompt_ids: list[int]) -> GenerationResult:
        ids = torch.tensor([prompt_ids], device=self.device)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        t0 = time.perf_counter()
        stats = self.device.type == "cuda"  # its stats path calls torch.cuda.synchronize unconditionally
        out = self._generate(self.draft, target=self.target, input_ids=ids, max_new_tokens=self.max_new_tokens,
                             stop_token_ids=self.eos, return_stats=stats)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        elapsed = time.perf_counter() - t0
        output_ids = out.output_ids if stats else out
        new = output_ids[0, len(prompt_ids):].tolist()
        for i, t in enumerate(new):
            if t in self.eos:
                new = new[: i + 1]
                break
        reason = "eos" if new and new[-1] in self.eos else "length"
        forwards = len(out.acceptance_lengths) if stats else 0  # 0 = not reported (CPU)
        return GenerationResult(list(prompt_ids), new, reason, num_target_forwards=forwards, decode_s=elapsed)


def stock_system(target, drafter, drafter_kind: str, num_draft_tokens: int, **hf):
    """The released speculative system for a deployment -> (generate, label): z-lab's `dflash` loop for a DFlash
    drafter, transformers' assisted generation for a small AR drafter, its prompt lookup for n-gram drafting.
    `target`, `drafter`: names or folders (the drafter is not read for n-gram drafting). `hf`: dtype, device,
    max_new_tokens, eos_ids, and optionally model (transformers' target, already loaded in that dtype and device).
    Raises ConfigError when the stock package is missing."""
    from specpilot.hub import resolve_model

    target = resolve_model(target)
    if drafter_kind == "dflash":
        return DFlashStockSystem(target, resolve_model(drafter), **hf).generate, "z-lab dflash"
    if drafter_kind == "model":
        system = HFSystem(target, assistant_path=resolve_model(drafter), **hf)
        return system.generate, "transformers assisted generation"
    return HFSystem(target, prompt_lookup=num_draft_tokens, **hf).generate, "transformers prompt lookup"
