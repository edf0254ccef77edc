"""HiDup's cache on disk: what takes seconds to find and depends only on code and inputs that a
key names (a zoo model's captured graph: hidup.models.capture_model; what autograd keeps of an
ATen op: hidup.graph.saved). HIDUP_CACHE names the folder (default ~/.cache/hidup; 'off': no
cache). Entries are written whole or not at all (a file written aside, then renamed), so ranks
and commands running at once share the folder; an entry that cannot be read is found again."""
from __future__ import annotations

import hashlib
import os
import pickle
from pathlib import Path

import torch


def cache_folder(kind: str) -> Path | None:
    """The folder of one kind of entry ('graphs', 'probes'), None where the cache is off."""
    folder = os.environ.get("HIDUP_CACHE", str(Path.home() / ".cache" / "hidup"))
    return None if folder == "off" else Path(folder) / kind


def code_digest(sources) -> str:
    """A digest of these source files and of torch's version: an entry found by other code is
    not read back."""
    digest = hashlib.sha256(torch.__version__.encode())
    for source in sorted(sources):
        digest.update(Path(source).read_bytes())
    return digest.hexdigest()


def write_entry(path: Path, dump) -> bool:
    """Write an entry by `dump(file)`: aside first, then renamed into place. False (nothing
    written) where the folder cannot be written or the value does not pickle."""
    partial = path.with_suffix(f".{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(partial, "wb") as f:
            dump(f)
        os.replace(partial, path)
        return True
    except (OSError, pickle.PicklingError, TypeError):
        partial.unlink(missing_ok=True)
        return False
