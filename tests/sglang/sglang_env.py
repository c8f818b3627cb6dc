"""Process setup shared by the SGLang recorders; import it before anything from `sglang`.

Run the recorders with a venv made by tests/sglang/install.sh. SGLang builds its page-hash
binding with torch's JIT loader on first use, which runs `ninja` from PATH and caches the build
under TORCH_EXTENSIONS_DIR; every release names the extension alike but ships different
sources, so each venv keeps its own build directory.
"""
import os
import sys

_bin = os.path.join(sys.prefix, "bin")
os.environ["PATH"] = _bin + os.pathsep + os.environ.get("PATH", "")
os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(sys.prefix, "torch-ext"))
# No telemetry, no downloads: everything the recorders need is local.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("PYTHONHASHSEED", "0")


def sglang_version():
    import importlib.metadata

    return importlib.metadata.version("sglang")


def library_versions(*names):
    """Versions of the packages a recording depends on, for its header."""
    import importlib.metadata

    out = {}
    for name in names:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out
