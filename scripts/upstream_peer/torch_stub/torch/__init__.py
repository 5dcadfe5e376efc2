"""Permissive import-time stub of torch (NO functionality). Any attribute is a dummy class;
any torch.* submodule import yields a permissive module. Only used so that flash_attn.cute /
quack import-time references (dtype dict keys, annotations, decorators, base classes) resolve."""
import sys, types, importlib.abc, importlib.machinery


class _Meta(type):
    def __getattr__(cls, name):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return _make(f"{cls.__name__}.{name}")

    def __call__(cls, *args, **kwargs):
        # decorator use: @torch.x(...)(fn) or @torch.x fn -> return fn unchanged
        if len(args) == 1 and not kwargs and callable(args[0]) and not isinstance(args[0], _Meta):
            return args[0]
        return _make(f"{cls.__name__}()")

    def __getitem__(cls, item):
        return cls

    def __or__(cls, other):
        return cls

    __ror__ = __or__

    def __repr__(cls):
        return f"<torch-stub {cls.__name__}>"


def _make(name):
    return _Meta(name, (object,), {})


class _StubModule(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        val = _make(f"{self.__name__}.{name}")
        setattr(self, name, val)
        return val


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path, target=None):
        if fullname.startswith("torch."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        m = _StubModule(spec.name)
        m.__path__ = []
        return m

    def exec_module(self, module):
        pass


sys.meta_path.insert(0, _Finder())
sys.modules[__name__].__class__ = _StubModule
__version__ = "0.0.0+stub"
Tensor = _make("torch.Tensor")
