"""Build hook: ship the kernel sources this package uses (from the repository's metal/)."""

from pathlib import Path

from hatchling.builders.hooks.plugin.interface import BuildHookInterface


class KernelSources(BuildHookInterface):
    PLUGIN_NAME = "custom"

    def initialize(self, version, build_data):
        root = Path(self.root)
        # a repository checkout keeps them in ../../metal; an sdist carries its own metal/
        src = next((d for d in (root / "metal", root.parent.parent / "metal") if d.is_dir()), None)
        if src is None:
            raise FileNotFoundError(f"kernel sources not found beside {root}")
        target = self.config["target"] if self.target_name == "wheel" else "metal"
        for pattern in self.config.get("kernels", []):
            for f in sorted(src.glob(pattern)):
                build_data["force_include"][str(f)] = f"{target}/{f.name}"
