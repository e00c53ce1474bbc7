"""Import an installed velox package in a fresh environment and check what its wheel ships.

python tools/check_wheel.py velox_core
"""

from __future__ import annotations

import importlib
import sys
from importlib import resources
from importlib.metadata import entry_points


def main(module: str) -> int:
    mod = importlib.import_module(module)
    print(f"{module} {getattr(mod, '__version__', '?')} imported from {mod.__file__}")
    kernels = resources.files(module) / "kernels" / "src"
    if module == "velox_core" and not kernels.is_dir():
        print("velox_core: the wheel ships no kernel sources (kernels/src)", file=sys.stderr)
        return 1
    if kernels.is_dir():
        names = sorted(p.name for p in kernels.iterdir())
        if not names:
            print(f"{module}: kernels/src is empty", file=sys.stderr)
            return 1
        print(f"  kernel sources: {', '.join(names)}")
    own = resources.files(module) / "metal"  # a method package's own kernel sources
    if own.is_dir():
        print(f"  its kernel sources: {', '.join(sorted(p.name for p in own.iterdir()))}")
    try:  # a method package's code layout registers when its layout module is imported
        importlib.import_module(module + ".layout")
    except ModuleNotFoundError:
        pass
    from velox_core.kernels import kernel_source
    from velox_core.kernels.layout import layouts

    for lay in layouts():
        if lay.key_pass is not None and lay.package == module:
            try:
                kernel_source(lay.key_pass, lay.package)
            except FileNotFoundError:
                print(f"{module}: layout {lay.name!r}'s {lay.key_pass} is not in the wheel")
                return 1
            print(f"  layout {lay.name}: key pass {lay.key_pass}")
    eps = [
        ep
        for ep in entry_points(group="velox.methods")
        if ep.value.startswith(module + ".") or ep.value.startswith(module + ":")
    ]
    for ep in eps:
        method = ep.load()
        print(f"  method {method.name}: {method.cache_class.__name__}")
    from velox_core.hosts import Host, get_host

    for ep in entry_points(group="velox.hosts"):  # a host package's (velox-vlm's)
        if ep.value.startswith(module + ".") or ep.value.startswith(module + ":"):
            obj = ep.load()
            host = obj if isinstance(obj, Host) else obj()
            if get_host(host.name).name != host.name:  # velox-core finds it too
                return 1
            print(f"  host {host.name}: attention {host.attention[0]}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
