"""Makes torch 1.13's DCP importable under Python 3.11 (Debian's /usr/bin/python3).

torch/distributed/_shard/sharded_tensor/metadata.py declares a dataclass field with a mutable
default (`field(default=TensorProperties())`), which Python 3.11 rejects at import. This import
hook compiles that module's source with `default_factory` instead, in memory: no file of the
system is touched (the same fix as bench/peers/dcp_bench.py). Import this module before torch.
"""
import importlib.abc
import importlib.machinery
import sys

_FIXES = {
    "torch.distributed._shard.sharded_tensor.metadata": [
        ("tensor_properties: TensorProperties = field(default=TensorProperties())",
         "tensor_properties: TensorProperties = field(default_factory=TensorProperties)"),
    ],
}


class _PatchedSourceLoader(importlib.machinery.SourceFileLoader):
    def get_code(self, fullname):
        source = self.get_data(self.path).decode("utf-8")
        for old, new in _FIXES[fullname]:
            source = source.replace(old, new)
        return compile(source, self.path, "exec", dont_inherit=True)


class _PatchingFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname not in _FIXES:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or not isinstance(spec.loader, importlib.machinery.SourceFileLoader):
            return spec
        spec.loader = _PatchedSourceLoader(fullname, spec.origin)
        return spec


if sys.version_info >= (3, 11) and not any(isinstance(f, _PatchingFinder) for f in sys.meta_path):
    sys.meta_path.insert(0, _PatchingFinder())
