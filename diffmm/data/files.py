"""The one JSON writer of diffmm (atomic, so a reader never sees half a file) and a forgiving JSON reader."""
from __future__ import annotations

import json
import logging
import math
import os
import tempfile
from typing import Any, Optional

log = logging.getLogger("diffmm.data")


def _finite(obj: Any) -> Any:
    """``obj`` with NaN and infinities replaced by ``None`` (JSON has no such numbers)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def write_json_atomic(path: str | os.PathLike, obj: Any, sort_keys: bool = False) -> str:
    """Write ``obj`` as indented JSON through a temporary file and a rename; returns the path.

    Parent folders are created; NaN and infinities become ``null``. An interrupted write leaves
    the old file (or none), never a partial one.

    Args:
        path: the JSON file.
        obj: anything ``json.dump`` takes.
        sort_keys: sort the keys of every object.
    """
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".json", dir=directory)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(_finite(obj), f, indent=1, sort_keys=sort_keys)
            f.write("\n")
        os.chmod(tmp, 0o644)  # mkstemp makes it private; a JSON result is as readable as a plain open() makes it
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    return path


def read_json(path: str) -> Optional[dict]:
    """The JSON object in ``path``; ``None`` when the file is missing, or (with a warning) unreadable or not an
    object."""
    try:
        with open(path) as f:
            data = json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        log.warning("ignoring %s: not readable JSON (%s)", path, e)
        return None
    return data if isinstance(data, dict) else None
