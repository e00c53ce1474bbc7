"""What velox's benchmark scripts share. A script runs as ``python benchmarks/NAME.py``, which
puts this folder on ``sys.path``, and imports it as ``from _common import ...``."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def write_json(path: str | os.PathLike | None, payload: Any) -> None:
    """Write ``payload`` as indented JSON to ``path`` (a script's ``--json``), its folder made
    first; nothing where ``path`` is None or empty (no ``--json`` given)."""
    if not path:
        return
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=1) + "\n")
