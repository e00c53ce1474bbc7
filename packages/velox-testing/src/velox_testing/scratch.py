"""A folder for the artifacts a test session fits or writes, removed when it ends."""

from __future__ import annotations

import atexit
import shutil
import tempfile
from pathlib import Path

__all__ = ["scratch_dir"]


def scratch_dir(prefix: str) -> Path:
    """A new temporary folder (named ``prefix`` + a random part), removed with its contents
    when the process exits (for artifacts cached across a module's tests, where pytest's
    ``tmp_path`` is per test)."""
    path = Path(tempfile.mkdtemp(prefix=prefix))
    atexit.register(shutil.rmtree, path, True)
    return path
