"""torch 1.13 on Python 3.11: two torch modules fail to import; this fixes them in memory.

Importing this module installs an import hook (only on Python >= 3.11) that compiles the
fixed source of those modules when they are imported; no file is touched, no bytecode is
written. It is a no-op for a torch that is already fixed. The same fix as
bench/peers/dcp_bench.py:

- torch/distributed/_shard/sharded_tensor/metadata.py: `field(default=TensorProperties())` is
  a mutable dataclass default, which 3.11 rejects -> default_factory. (Needed for
  torch.distributed._shard.sharded_tensor, i.e. torch's ShardedTensor.)
- torch/distributed/elastic/multiprocessing/api.py: iterating an IntFlag skips members on
  3.11 -> the members listed.

Import it before torch.distributed._shard (test modules and the documentation examples do).
"""

import importlib.abc
import importlib.machinery
import sys

_FIXES = {
    "torch.distributed._shard.sharded_tensor.metadata": [
        ("tensor_properties: TensorProperties = field(default=TensorProperties())",
         "tensor_properties: TensorProperties = field(default_factory=TensorProperties)"),
    ],
    "torch.distributed.elastic.multiprocessing.api": [
        ("for s in Std:", "for s in (Std.NONE, Std.OUT, Std.ERR, Std.ALL):"),
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
