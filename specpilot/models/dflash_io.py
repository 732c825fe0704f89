"""Load and save DFlash drafters in z-lab's published format, unchanged.

A checkpoint folder holds `config.json` (a transformers Qwen3 config with `architectures: ["DFlashDraftModel"]`,
top-level `block_size` and `dflash_config: {mask_token_id, target_layer_ids}`) and safetensors weights, one file
(`model.safetensors`) or shards listed in `model.safetensors.index.json`. Tensor names are the module names of
`DFlashDrafter` (`layers.N.self_attn.q_proj.weight`, `fc.weight`, `hidden_norm.weight`, `norm.weight`, ...); the
embedding and LM head are the target's and are not stored.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from specpilot.errors import ModelFormatError
from specpilot.models.config import read_config_json
from specpilot.models.dense import rope_inv_freq
from specpilot.models.dflash import DFlashConfig, DFlashDrafter

_INDEX = "model.safetensors.index.json"
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # buffers some exporters write; recomputed here


def read_dflash_config(path: str | Path) -> DFlashConfig:
    path = Path(path)
    cfg = read_config_json(path, "a DFlash checkpoint folder")
    return DFlashConfig.from_hf_dict(cfg)


def _weight_files(path: Path) -> list[Path]:
    index = path / _INDEX
    if index.exists():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (json.JSONDecodeError, KeyError, AttributeError) as e:
            raise ModelFormatError(f"{index} is not a safetensors index: {e}") from None
        return [path / n for n in names]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelFormatError(f"{path} holds no *.safetensors weights")
    return files


def load_dflash(
    path: str | Path, dtype: torch.dtype | None = torch.float32, device: str | torch.device = "cpu"
) -> DFlashDrafter:
    """A z-lab DFlash checkpoint folder -> `DFlashDrafter` (eval mode). `dtype=None` keeps the stored dtypes."""
    path = Path(path)
    cfg = read_dflash_config(path)
    with torch.device("meta"):
        drafter = DFlashDrafter(cfg)
    state: dict[str, torch.Tensor] = {}
    for f in _weight_files(path):
        try:
            with safe_open(str(f), framework="pt", device=str(device)) as fh:
                for name in fh.keys():
                    t = fh.get_tensor(name)
                    state[name] = t if dtype is None else t.to(dtype)
        except Exception as e:  # safetensors raises its own error types for missing/truncated files
            raise ModelFormatError(f"cannot read DFlash weights {f}: {e}") from None
    params = dict(drafter.named_parameters())
    missing = params.keys() - state.keys()
    unexpected = {n for n in state.keys() - params.keys() if not n.endswith(_IGNORED_SUFFIXES)}
    if missing or unexpected:
        raise ModelFormatError(
            f"{path}: weights do not match the DFlash config ({cfg.num_hidden_layers} layers, "
            f"{len(cfg.target_layer_ids)} target layers): missing {sorted(missing)[:5]}, "
            f"unexpected {sorted(unexpected)[:5]}"
        )
    wrong = [(n, tuple(state[n].shape), tuple(p.shape)) for n, p in params.items() if state[n].shape != p.shape]
    if wrong:
        n, got, want = wrong[0]
        raise ModelFormatError(
            f"{path}: weight {n} has shape {got}, the config implies {want} ({len(wrong)} mismatched)"
        )
    drafter.load_state_dict({n: state[n] for n in params}, strict=False, assign=True)
    drafter.inv_freq = rope_inv_freq(cfg).to(device)  # buffers were made on meta: rebuild on the real device
    return drafter.eval()


def save_dflash(drafter: DFlashDrafter, path: str | Path, *, max_shard_bytes: int = 4 << 30) -> None:
    """Write `drafter` as a z-lab DFlash checkpoint (config.json + safetensors, sharded above `max_shard_bytes`)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    state = {n: p.detach().contiguous().cpu() for n, p in drafter.named_parameters()}
    dtypes = {t.dtype for t in state.values()}
    cfg = drafter.config.to_hf_dict()
    if len(dtypes) == 1:
        cfg["dtype"] = str(dtypes.pop()).removeprefix("torch.")
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in state.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    for stale in [*path.glob("model*.safetensors"), path / _INDEX]:
        stale.unlink(missing_ok=True)
    if len(shards) == 1:
        save_file(shards[0], str(path / "model.safetensors"), metadata={"format": "pt"})
    else:
        weight_map = {}
        for i, shard in enumerate(shards, 1):
            fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, str(path / fname), metadata={"format": "pt"})
            weight_map.update({name: fname for name in shard})
        total = sum(t.numel() * t.element_size() for t in state.values())
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (path / _INDEX).write_text(json.dumps(index, indent=2) + "\n")
    (path / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
