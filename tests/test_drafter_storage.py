"""Low-precision storage of drafters (int8/int4), the narrower draft MLP, and shipped drafters by name."""

from __future__ import annotations

import json

import pytest
import torch

from specpilot.errors import ConfigError, ModelFormatError
from specpilot.models import load_model
from specpilot.models.dflash_io import export_zlab, load_dflash, read_storage, save_dflash
from specpilot.models.weight_storage import dequantize, quantize
from specpilot.train import dflash_trainer as dt
from specpilot.train.dflash_init import mlp_neurons


@pytest.mark.parametrize("fmt,qmax", [("int8", 127), ("int4", 7)])
@pytest.mark.parametrize("group", [8, 32])
def test_quantize_roundtrip_error_is_within_half_a_step(fmt, qmax, group):
    w = torch.randn(24, 64, generator=torch.Generator().manual_seed(0)) * torch.linspace(0.01, 3, 64)
    codes, scale = quantize(w, fmt, group)
    assert scale.dtype == torch.float16 and scale.shape == (24, 64 // group)
    assert codes.shape == ((24, 64) if fmt == "int8" else (24, 32))
    back = dequantize(codes, scale, fmt)
    step = scale.float().repeat_interleave(group, dim=1)
    err = (back - w).abs()
    assert bool((err <= 0.5 * step + 1e-3 * w.abs() + 1e-6).all())  # fp16 scale rounding adds a relative 1e-3
    assert float(err.max()) > 0  # it is a lossy store: a test that always passes would hide a no-op
    # the largest value of each group is representable (codes reach +-qmax)
    vals = back.reshape(24, 64 // group, group).abs().amax(-1)
    ref = w.reshape(24, 64 // group, group).abs().amax(-1)
    assert torch.allclose(vals, ref, rtol=2e-3)


def test_int4_packing_is_low_nibble_first():
    w = torch.tensor([[1.0, -7.0, 7.0, 0.0]])
    codes, scale = quantize(w, "int4", 4)
    assert float(scale) == 1.0
    assert codes.tolist() == [[(1 + 8) | ((-7 + 8) << 4), (7 + 8) | (8 << 4)]]
    assert dequantize(codes, scale, "int4").tolist() == w.tolist()


def test_quantize_rejects_bad_input():
    with pytest.raises(ConfigError):
        quantize(torch.randn(4, 10), "int4", 4)  # 10 is not a multiple of 4
    with pytest.raises(ConfigError):
        quantize(torch.randn(4, 8), "int3", 4)
    with pytest.raises(ConfigError):
        quantize(torch.randn(8), "int8", 4)
    codes, scale = quantize(torch.randn(4, 8), "int8", 4)
    with pytest.raises(ModelFormatError):
        dequantize(codes.to(torch.uint8), scale, "int8")


@pytest.fixture(scope="module")
def target(tiny_model_dir):
    return load_model(tiny_model_dir("qwen3"))


def _drafter(target, **kw):
    return dt.build_drafter_for(target, num_layers=2, block_size=4, mask_token_id=5, **kw)


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_quantized_checkpoint_loads_close_to_the_original_and_is_smaller(target, tmp_path, fmt):
    d = _drafter(target)
    with torch.no_grad():
        for p in d.parameters():
            p.add_(0.05 * torch.randn_like(p))
    save_dflash(d, tmp_path / "f32")
    save_dflash(d, tmp_path / fmt, storage=fmt, group_size=16)
    assert read_storage(tmp_path / fmt) == {"format": fmt, "group_size": 16}
    assert read_storage(tmp_path / "f32") is None
    size = lambda p: sum(f.stat().st_size for f in p.glob("*.safetensors"))  # noqa: E731
    assert size(tmp_path / fmt) < size(tmp_path / "f32") / (3 if fmt == "int8" else 5)
    back = load_dflash(tmp_path / fmt)
    ref = dict(d.named_parameters())
    for name, p in back.named_parameters():
        tol = 0.02 if fmt == "int8" else 0.2
        assert torch.allclose(p, ref[name], atol=tol * float(ref[name].detach().abs().max()) + 1e-2), name
    # a z-lab export of the quantized checkpoint holds exactly the weights SpecPilot computes with
    export_zlab(tmp_path / fmt, tmp_path / "zlab", dtype="float32")
    assert read_storage(tmp_path / "zlab") is None
    plain = load_dflash(tmp_path / "zlab")
    for (n1, p1), (n2, p2) in zip(back.named_parameters(), plain.named_parameters()):
        assert n1 == n2 and torch.equal(p1, p2)


def test_quantized_checkpoint_errors_are_clear(target, tmp_path):
    d = _drafter(target)
    save_dflash(d, tmp_path / "q", storage="int8", group_size=16)
    cfg = json.loads((tmp_path / "q" / "config.json").read_text())
    del cfg["specpilot_storage"]
    (tmp_path / "q" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelFormatError, match="quantized"):
        load_dflash(tmp_path / "q")
    cfg["specpilot_storage"] = {"format": "int2", "group_size": 16}
    (tmp_path / "q" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelFormatError, match="specpilot_storage"):
        load_dflash(tmp_path / "q")
    with pytest.raises(ConfigError):
        save_dflash(d, tmp_path / "bad", storage="fp4")


def test_shards_respect_the_size_limit(target, tmp_path):
    d = _drafter(target)
    save_dflash(d, tmp_path / "s", storage="int8", group_size=16, max_shard_bytes=20_000)
    shards = sorted((tmp_path / "s").glob("*.safetensors"))
    assert len(shards) > 1 and (tmp_path / "s" / "model.safetensors.index.json").exists()
    load_dflash(tmp_path / "s")  # reads back through the index


def test_narrow_mlp_keeps_the_strongest_target_neurons(target):
    I = target.config.intermediate_size
    d = _drafter(target, intermediate_size=I // 2)
    assert d.config.intermediate_size == I // 2
    assert d.layers[0].mlp.gate_proj.weight.shape == (I // 2, target.config.hidden_size)
    last = target.model.layers[target.config.num_hidden_layers - 1].mlp  # draft layer 1 copies the last layer
    keep = mlp_neurons(last, I // 2)
    assert keep.numel() == I // 2 and bool((keep[1:] > keep[:-1]).all())
    assert torch.equal(d.layers[1].mlp.up_proj.weight, last.up_proj.weight[keep])
    assert torch.equal(d.layers[1].mlp.down_proj.weight, last.down_proj.weight[:, keep])
    score = (last.gate_proj.weight.norm(dim=1) * last.up_proj.weight.norm(dim=1) * last.down_proj.weight.norm(dim=0))
    dropped = torch.ones(I, dtype=torch.bool)
    dropped[keep] = False
    assert float(score[keep].min()) >= float(score[dropped].max())
    with pytest.raises(ConfigError):
        _drafter(target, intermediate_size=I + 1)
    with pytest.raises(ConfigError):
        _drafter(target, intermediate_size=0)


def test_shipped_drafters_resolve_by_name(monkeypatch, tmp_path, target):
    from specpilot.hub import registry

    monkeypatch.setattr(registry, "SHIPPED_DIR", tmp_path)
    save_dflash(_drafter(target), tmp_path / "dflash-tiny", storage="int4", group_size=16)
    assert registry.resolve_model("dflash-tiny") == tmp_path / "dflash-tiny"
    rows = {r["name"]: r for r in registry.list_models()}
    assert rows["dflash-tiny"]["status"] == "shipped" and rows["dflash-tiny"]["size_bytes"] > 0
    with pytest.raises(Exception, match="dflash-tiny"):  # the error lists shipped names among the known ones
        registry.resolve_model("dflash-tinyy")


def test_every_shipped_drafter_loads_and_has_a_model_card():
    from specpilot.hub.registry import shipped_drafters

    for name, path in shipped_drafters().items():
        assert (path / "README.md").is_file(), name
        assert sum(f.stat().st_size for f in path.iterdir()) <= 64 << 20, name
        cfg = json.loads((path / "config.json").read_text())
        assert cfg["architectures"] == ["DFlashDraftModel"]
        d = load_dflash(path)
        assert d.config.block_size == cfg["block_size"]
