"""On the GPU after scripts/gpu_pipeline.sh: validation tau of each trained drafter (fp32 master weights cast
to bf16) and of its shipped int4 export, on the run's own validation prompts -> /tmp/runs/storage_tau.json."""

import json
from pathlib import Path

import torch

from specpilot.models import load_model
from specpilot.models.dflash_io import load_dflash
from specpilot.train.data import build_prompt_splits
from specpilot.train.loop import validate_tau
from specpilot.train.regenerate import read_cache

SHIP = {"q15": "dflash-qwen2.5-coder-1.5b", "q05": "dflash-qwen2.5-coder-0.5b"}
out = {}
for m, name in SHIP.items():
    run = Path(f"/tmp/runs/{m}")
    if not (run / "best").exists() or not Path(f"/tmp/ship/{name}").exists():
        continue
    target = load_model(f"/tmp/models/{m}", dtype=torch.bfloat16, device="cuda")
    cfg = json.loads((run / "train_config.json").read_text())
    _, val_p = build_prompt_splits(cfg["data"], cfg["num_prompts"], cfg["val_prompts"], seed=cfg["seed"],
                                   dataset_dir=cfg.get("dataset_dir"))
    recs = read_cache(run / "regen")
    val = [recs[p.id]["prompt_ids"] for p in val_p if recs.get(p.id, {}).get("response_ids")][:16]
    out[m] = {}
    for label, path in (("trained", run / "best"), ("shipped_int4", Path(f"/tmp/ship/{name}"))):
        d = load_dflash(path, dtype=torch.float32, device="cuda")
        out[m][label] = round(validate_tau(target, d, val, max_new_tokens=128)["tau"], 4)
    print(m, out[m], flush=True)
    del target
    torch.cuda.empty_cache()
Path("/tmp/runs/storage_tau.json").write_text(json.dumps(out, indent=1))
