"""Where a portable checkpoint lives on disk, how a save replaces it, and which directory a load reads.

For a checkpoint at ``PATH`` (the name the caller gives):

* ``PATH``: the checkpoint, a directory holding ``metadata.json``, its checksum
  ``metadata.json.sha256`` and the parts; or a symlink to one.
* ``PATH.partial``: a save in progress. It holds :data:`MARKER` from the moment it is created:
  ``{"zero": "unfinished save", "of": "<PATH's name>", "set_aside": null | "<PATH.replaced's name>"}``.
* ``PATH.replaced``: the previous ``PATH``, set aside for the moment between a save's two renames.

A save (rank 0 does every step here; every rank writes its part between steps 1 and 2):

1. :func:`prepare`: finish or clear what an interrupted save of ``PATH`` left (below), create
   ``PATH.partial`` with the marker (made as a hidden ``.PATH.partial.XXXXXXXX`` and renamed, so it
   never exists without it; such a hidden directory that a crash left is removed when it holds the
   marker or nothing). Anything else at these three names is refused, never deleted:
   ``PATH`` if it is not a zero checkpoint, ``PATH.partial`` without the marker of a save of
   ``PATH``, ``PATH.replaced`` that no such marker claims.
2. :func:`publish`: write ``metadata.json.sha256``, then ``metadata.json`` (a temporary file renamed):
   from now on ``PATH.partial`` is a complete checkpoint.
3. If ``PATH`` exists, record ``set_aside`` in the marker and rename ``PATH`` to ``PATH.replaced``.
4. Rename ``PATH.partial`` to ``PATH`` (the marker goes with it): the save is published.
5. Remove ``PATH.replaced`` (a symlink is unlinked, its target left alone; a directory is removed),
   then the marker. A failure here is a warning: the checkpoint is saved.

**A symlink at PATH** is replaced, not followed: after the save ``PATH`` is a directory holding the
new checkpoint, and the directory the link pointed to is left exactly as it was. (Following it
would write step N+k's state under a name the user gave step N.)

What a crash after each step leaves, and what :func:`resolve` (every load) reads:

=====================  ================================================  ==============================
a crash                on disk                                           loading ``PATH`` reads
=====================  ================================================  ==============================
before step 2 is done  ``PATH`` (old, if any), unfinished ``.partial``   the old checkpoint (none:
                                                                         refused, naming the
                                                                         unfinished save)
after step 2           ``PATH`` (old, if any), complete ``.partial``     the old checkpoint (none: the
                                                                         new one, in ``PATH.partial``)
after step 3           ``.replaced`` (old), complete ``.partial``        the new one, in
                                                                         ``PATH.partial``
after step 4           ``PATH`` (new, with the marker), ``.replaced``    the new checkpoint
=====================  ================================================  ==============================

The next save of ``PATH`` first finishes or clears that state with :func:`prepare`: a complete
``PATH.partial`` whose rename never happened is renamed into place (after step 3, or after 2 when
there was no ``PATH``), an unfinished or superseded one is removed, a claimed ``PATH.replaced`` is
removed. So a load after any sequence of crashes reads the newest complete save or the one before.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import shutil
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any

METADATA = "metadata.json"
CHECKSUM = METADATA + ".sha256"  # ``sha256sum -c`` reads it
MARKER = ".zero-unfinished-save"
PARTIAL_SUFFIX = ".partial"  # a save in progress (or one that died)
REPLACED_SUFFIX = ".replaced"  # the previous checkpoint, while a save over it renames the new one in


def siblings(final: Path) -> tuple[Path, Path]:
    """``(PATH.partial, PATH.replaced)`` of ``final``."""
    return final.with_name(final.name + PARTIAL_SUFFIX), final.with_name(final.name + REPLACED_SUFFIX)


# ----- saving ------------------------------------------------------------------------------------------------


def prepare(final: Path) -> Path:
    """Step 1 (rank 0, before any part is written): finish or clear an interrupted save of ``final``, refuse
    what is not ours, and create ``PATH.partial`` with the marker. Returns it. A refusal changes nothing."""
    partial, replaced = siblings(final)
    mark = _marker(partial, final)
    recover = mark is not None and not _present(final) and (partial / METADATA).is_file()
    after = _marker(partial if recover else final, final)
    claimed = after is not None and after.get("set_aside") == replaced.name
    if _present(final) and not (final / METADATA).is_file():
        raise FileExistsError(f"{_described(final)} exists and is not a zero checkpoint (no {METADATA}); refusing to "
                              "replace it. Choose another path or remove it.")
    if _present(partial) and mark is None:
        raise FileExistsError(f"{_described(partial)} exists and does not carry zero's marker of an unfinished save of "
                              f"{final} ({MARKER}): it is not ours to delete. Move or remove it, or save elsewhere.")
    if _present(replaced) and not claimed:
        raise FileExistsError(f"{_described(replaced)} exists and no unfinished zero save of {final} set it aside: "
                              "it is not ours to delete. Move or remove it (it may be a checkpoint you want to keep).")
    if recover:
        os.rename(partial, final)  # a complete save whose rename a crash prevented: publish it first
        _fsync_dir(final.parent)
    elif mark is not None:
        shutil.rmtree(partial)  # an unfinished save, or a complete one this save supersedes
    if after is not None:
        _finish(final, replaced)
    partial.parent.mkdir(parents=True, exist_ok=True)
    for debris in partial.parent.glob(glob.escape(f".{partial.name}.") + "*"):
        if _marker(debris, final) is not None:
            shutil.rmtree(debris)  # a PATH.partial being created when a crash came
        elif debris.is_dir() and not debris.is_symlink() and not any(debris.iterdir()):
            debris.rmdir()
    staging = Path(tempfile.mkdtemp(dir=partial.parent, prefix=f".{partial.name}."))
    with open(staging / MARKER, "x") as f:  # a new directory of ours: written in place
        f.write(_marker_text(final, set_aside=None))
        f.flush()
        os.fsync(f.fileno())
    os.rename(staging, partial)  # PATH.partial appears with its marker already in it
    _fsync_dir(partial.parent)
    return partial


def publish(partial: Path, final: Path, metadata: bytes) -> str | None:
    """Steps 2-5 (rank 0, once every rank's part is written and fsynced): the metadata and its checksum, then the
    renames. Returns a note for the caller's report when ``final`` was a symlink, else None."""
    digest = hashlib.sha256(metadata).hexdigest()
    _write_durably(partial / CHECKSUM, f"{digest}  {METADATA}\n".encode())
    _write_durably(partial / METADATA, metadata)
    _, replaced = siblings(final)
    note = f"{final} was a symlink to {os.readlink(final)}, which is left as it was" if final.is_symlink() else None
    if _present(final):
        if _present(replaced):
            raise FileExistsError(f"{_described(replaced)} appeared during the save; it is not ours to replace. "
                                  f"The complete save is in {partial}.")
        _write_durably(partial / MARKER, _marker_text(final, set_aside=replaced.name).encode())
        os.rename(final, replaced)
        _fsync_dir(final.parent)
    os.rename(partial, final)
    _fsync_dir(final.parent)
    try:
        _finish(final, replaced)
    except OSError as err:
        warnings.warn(f"saved {final}, but could not remove {replaced} or {final / MARKER} ({err}); the next save of "
                      f"{final} removes them", stacklevel=2)
    return note


def _finish(final: Path, replaced: Path) -> None:
    """Step 5: remove the previous checkpoint set aside (a symlink: only the link), then the marker."""
    if _present(replaced):
        if replaced.is_symlink():
            replaced.unlink()
        else:
            shutil.rmtree(replaced)
        _fsync_dir(final.parent)
    (final / MARKER).unlink()
    _fsync_dir(final)


def _marker(directory: Path, final: Path) -> dict[str, Any] | None:
    """The marker of an unfinished save of ``final`` in ``directory`` (a real directory), or None."""
    if directory.is_symlink() or not directory.is_dir():
        return None
    try:
        value = json.loads((directory / MARKER).read_text())
    except (OSError, ValueError):
        return None
    if isinstance(value, dict) and value.get("zero") == "unfinished save" and value.get("of") == final.name:
        return value
    return None


def _marker_text(final: Path, set_aside: str | None) -> str:
    return json.dumps({"zero": "unfinished save", "of": final.name, "set_aside": set_aside})


def _write_durably(path: Path, data: bytes) -> None:
    """``data`` to ``path`` through a temporary file beside it (ours: inside a directory we created), fsynced."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.rename(tmp, path)
    _fsync_dir(path.parent)


def _present(path: Path) -> bool:
    return path.is_symlink() or path.exists()


def _described(path: Path) -> str:
    return f"{path} (a symlink to {os.readlink(path)})" if path.is_symlink() else str(path)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ----- loading -----------------------------------------------------------------------------------------------


def resolve(path: str | os.PathLike) -> Path:
    """The checkpoint directory a load of ``path`` reads: ``path`` (a symlink is followed), or when ``path`` is
    missing the complete save that an interrupted save of it left (``PATH.partial`` first: it is newer, then
    ``PATH.replaced``), said on stderr. A clear error for a missing or unfinished checkpoint."""
    path = Path(path)
    if (path / METADATA).is_file():
        return path
    if path.is_symlink() and not path.exists():
        raise FileNotFoundError(f"no checkpoint at {path}: it is a symlink to {os.readlink(path)}, "
                                "which does not exist")
    if path.exists():
        if path.name.endswith(PARTIAL_SUFFIX):
            raise ValueError(f"{path}: this save was never finished ({METADATA} is written last and is missing); "
                             "load the previous checkpoint instead")
        raise ValueError(f"{path} is not a zero checkpoint: it has no {METADATA} "
                         "(an unfinished save, or another format)")
    partial, replaced = siblings(path)
    if (partial / METADATA).is_file():
        print(f"zero: {path} is missing, but {partial} holds a complete save of it whose final rename a crash "
              "prevented; loading that (the next save of it renames it into place)", file=sys.stderr)
        return partial
    if (replaced / METADATA).is_file():
        print(f"zero: {path} is missing, but {replaced} holds the checkpoint a save over it set aside; loading that",
              file=sys.stderr)
        return replaced
    if partial.exists():
        raise ValueError(f"no checkpoint at {path}: {partial} holds a save of it that was never finished (no "
                         f"{METADATA}); load an earlier checkpoint")
    raise FileNotFoundError(f"no checkpoint at {path}")
