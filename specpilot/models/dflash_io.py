"""Load and save DFlash drafters in z-lab's published format, unchanged.

A checkpoint folder holds `config.json` (a transformers Qwen3 config with `architectures: ["DFlashDraftModel"]`,
top-level `block_size` and `dflash_config: {mask_token_id, target_layer_ids}`) and safetensors weights, one file
(`model.safetensors`) or shards listed in `model.safetensors.index.json`. Tensor names are the module names of
`DFlashDrafter` (`layers.N.self_attn.q_proj.weight`, `fc.weight`, `hidden_norm.weight`, `norm.weight`, ...); the
embedding and LM head are the target's and are not stored.

SpecPilot's shipped drafters use a smaller *storage* (`models/weight_storage.py`): config.json then holds
`specpilot_storage: {format: int8|int4, group_size}` and each matrix `X.weight` is stored as `X.weight_codes`
+ `X.weight_scale`; `load_dflash` dequantizes them, and `export_zlab` writes a plain z-lab folder again for tools
that read only that format (z-lab's own `dflash` package).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from specpilot.errors import ConfigError, ModelFormatError
from specpilot.models.config import read_config_json
from specpilot.models.dense import rope_inv_freq
from specpilot.models.dflash import DFlashConfig, DFlashDrafter
from specpilot.models.loader import check_device
from specpilot.models.weight_storage import FORMATS, check_format, dequantize, quantize

_INDEX = "model.safetensors.index.json"
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # buffers some exporters write; recomputed here
STORAGE_KEY = "specpilot_storage"
_CODES, _SCALE = ".weight_codes", ".weight_scale"
FLOAT_STORAGE = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


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
    check_device(device)
    path = Path(path)
    cfg = read_dflash_config(path)
    with torch.device("meta"):
        drafter = DFlashDrafter(cfg)
    raw: dict[str, torch.Tensor] = {}
    for f in _weight_files(path):
        try:
            with safe_open(str(f), framework="pt", device=str(device)) as fh:
                for name in fh.keys():
                    raw[name] = fh.get_tensor(name)
        except Exception as e:  # safetensors raises its own error types for missing/truncated files
            raise ModelFormatError(f"cannot read DFlash weights {f}: {e}") from None
    state = _dequantized(raw, read_storage(path), dtype)
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


def read_storage(path: str | Path) -> dict | None:
    """The checkpoint's low-precision storage spec ({format, group_size}), or None for plain float weights."""
    spec = read_config_json(Path(path), "a DFlash checkpoint folder").get(STORAGE_KEY)
    if spec is None:
        return None
    if not isinstance(spec, dict) or spec.get("format") not in FORMATS or not isinstance(spec.get("group_size"), int):
        raise ModelFormatError(f"{path}: config.json has a bad {STORAGE_KEY} {spec!r}")
    return spec


def _dequantized(raw: dict[str, torch.Tensor], storage: dict | None, dtype) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for name, t in raw.items():
        if name.endswith(_SCALE):
            continue
        if name.endswith(_CODES):
            if storage is None:
                raise ModelFormatError(f"{name} is quantized but config.json has no {STORAGE_KEY}")
            base = name[: -len(_CODES)]
            if base + _SCALE not in raw:
                raise ModelFormatError(f"{name} has no {base + _SCALE}")
            out[base + ".weight"] = dequantize(t, raw[base + _SCALE], storage["format"],
                                               dtype if dtype is not None else torch.bfloat16)
        else:
            out[name] = t if dtype is None else t.to(dtype)
    return out


def save_dflash(drafter: DFlashDrafter, path: str | Path, *, max_shard_bytes: int = 4 << 30, storage: str | None = None,
                group_size: int = 64) -> None:
    """Write `drafter` as a z-lab DFlash checkpoint (config.json + safetensors, sharded above `max_shard_bytes`).

    `storage`: None keeps the parameters' dtype; "float32"/"bfloat16"/"float16" casts; "int8"/"int4" stores every
    matrix quantized (groups of `group_size` inputs; norms stay bfloat16), readable by `load_dflash` only.
    A drafter with fused projections is saved under the split names (the drafter itself stays fused)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    if drafter.projections_fused:  # a run-time layout (fuse_projections): the checkpoint keeps z-lab's split names
        drafter = copy.deepcopy(drafter).fuse_projections(False)
    state = {n: p.detach().contiguous().cpu() for n, p in drafter.named_parameters()}
    cfg = drafter.config.to_hf_dict()
    cfg.pop(STORAGE_KEY, None)  # a loaded quantized checkpoint's spec: only the storage chosen here applies
    if storage in FORMATS:
        check_format(storage, group_size)
        packed: dict[str, torch.Tensor] = {}
        for name, t in state.items():
            if t.dim() == 2 and name.endswith(".weight"):
                codes, scale = quantize(t, storage, group_size)
                packed[name[: -len(".weight")] + _CODES] = codes
                packed[name[: -len(".weight")] + _SCALE] = scale
            else:
                packed[name] = t.to(torch.bfloat16)
        state = packed
        cfg[STORAGE_KEY] = {"format": storage, "group_size": int(group_size)}
        cfg["dtype"] = "bfloat16"
    else:
        if storage is not None:
            if storage not in FLOAT_STORAGE:
                raise ConfigError(f"storage must be one of {sorted(FLOAT_STORAGE) + sorted(FORMATS)}, got {storage!r}")
            state = {n: t.to(FLOAT_STORAGE[storage]) for n, t in state.items()}
        dtypes = {t.dtype for t in state.values()}
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


def export_zlab(src: str | Path, dst: str | Path, dtype: str = "bfloat16") -> Path:
    """Rewrite any checkpoint `load_dflash` reads (quantized storage included) as a plain z-lab folder in `dtype`:
    what z-lab's `dflash` package loads. The weights are those SpecPilot computes with, so both run one drafter."""
    drafter = load_dflash(src, dtype=FLOAT_STORAGE[dtype])
    save_dflash(drafter, dst)
    return Path(dst)
