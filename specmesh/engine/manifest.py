"""MANIFEST.sha256: per-file SHA-256 checksums of a model directory (sha256sum format).

`write_manifest` records every file under a directory; `verify_manifest` re-hashes them and
raises ModelIntegrityError naming each missing or modified file. The file is compatible with
`cd DIR && sha256sum -c MANIFEST.sha256`.
"""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path, PurePosixPath

from tqdm import tqdm

from specmesh.errors import ModelIntegrityError

log = logging.getLogger(__name__)

MANIFEST_NAME = "MANIFEST.sha256"
_TMP_NAME = f".{MANIFEST_NAME}.tmp"
_CHUNK = 1 << 20
_FIX = "run `specmesh fetch-model` to re-download and rebuild it"


def model_fingerprint(dir: Path | str) -> str:
    """What a model directory is: "sha256:" + 16 hex of its MANIFEST.sha256 (which names every file's
    checksum), or "" without a manifest (a user-supplied directory: identity unknown, not compared)."""
    path = Path(dir) / MANIFEST_NAME
    return f"sha256:{hashlib.sha256(path.read_bytes()).hexdigest()[:16]}" if path.is_file() else ""


def sha256_file(path: Path | str, progress: bool = False) -> str:
    """Hex SHA-256 of a file, read in 1 MiB chunks; optional tqdm byte bar."""
    path = Path(path)
    digest = hashlib.sha256()
    with open(path, "rb") as fh, tqdm(
        total=path.stat().st_size,
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        desc=f"sha256 {path.name}",
        disable=not progress,
        leave=False,
    ) as bar:
        while chunk := fh.read(_CHUNK):
            digest.update(chunk)
            bar.update(len(chunk))
    return digest.hexdigest()


def _list_files(root: Path) -> list[str]:
    """Relative POSIX paths of every regular file under root except the manifest, sorted."""
    names = []
    for path in root.rglob("*"):
        rel = path.relative_to(root).as_posix()
        if path.is_file() and rel not in (MANIFEST_NAME, _TMP_NAME):
            names.append(rel)
    return sorted(names)


def write_manifest(dir: Path, progress: bool = False) -> Path:
    """Write dir/MANIFEST.sha256 ("<hex>  <relative path>" per file, sorted) and return its path."""
    root = Path(dir)
    lines = [f"{sha256_file(root / rel, progress)}  {rel}\n" for rel in _list_files(root)]
    target = root / MANIFEST_NAME
    tmp = root / _TMP_NAME
    tmp.write_text("".join(lines), encoding="utf-8")
    os.replace(tmp, target)
    return target


def _parse_manifest(path: Path) -> dict[str, str]:
    """{relative path: hex} from a sha256sum-format file; rejects malformed or escaping entries."""
    entries: dict[str, str] = {}
    for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        digest, sep, rel = line.partition("  ")
        if not sep:  # sha256sum binary mode writes "<hex> *<path>"
            digest, sep, rel = line.partition(" *")
        parts = PurePosixPath(rel).parts
        bad_hex = len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest.lower())
        if not sep or bad_hex or not rel or rel.startswith("/") or ".." in parts:
            raise ModelIntegrityError(f"{path}: malformed line {lineno}: {line!r}; {_FIX}")
        entries[rel] = digest.lower()
    if not entries:
        raise ModelIntegrityError(f"{path} lists no files; {_FIX}")
    return entries


def verify_manifest(dir: Path, progress: bool = False) -> None:
    """Re-hash every file listed in dir/MANIFEST.sha256; raise ModelIntegrityError on any problem.

    The error names every missing file and every file whose checksum differs. Files present on
    disk but absent from the manifest are only logged (they do not fail verification).
    """
    root = Path(dir)
    manifest = root / MANIFEST_NAME
    if not root.is_dir():
        raise ModelIntegrityError(f"model directory {root} does not exist; {_FIX}")
    if not manifest.is_file():
        raise ModelIntegrityError(
            f"model directory {root} has no {MANIFEST_NAME} (incomplete or not built by "
            f"specmesh); {_FIX}"
        )
    entries = _parse_manifest(manifest)
    missing, mismatched = [], []
    for rel, expected in sorted(entries.items()):
        path = root / rel
        if not path.is_file():
            missing.append(rel)
        elif sha256_file(path, progress) != expected:
            mismatched.append(rel)
    extra = sorted(set(_list_files(root)) - set(entries))
    if extra:
        log.warning("%s: files not listed in %s: %s", root, MANIFEST_NAME, ", ".join(extra))
    if missing or mismatched:
        problems = []
        if missing:
            problems.append(f"missing: {', '.join(missing)}")
        if mismatched:
            problems.append(f"checksum mismatch (modified or corrupted): {', '.join(mismatched)}")
        raise ModelIntegrityError(
            f"model directory {root} failed verification against {MANIFEST_NAME} — "
            f"{'; '.join(problems)}. {_FIX[0].upper()}{_FIX[1:]}."
        )
