"""Fast production kernels in the CUTLASS CuTe DSL, one folder per GPU generation.

Importing this package registers, with dualattn.dispatch, every arch implementation whose
module imports. Each arch package registers its own implementation objects; an arch whose
module cannot import (no nvidia-cutlass-dsl, say) is reported by ``dualattn.explain``.
"""
import importlib

from dualattn import dispatch as _dispatch

IMPORT_ERRORS = {}
for _arch in ("sm90", "sm100", "sm120"):
    try:
        importlib.import_module(f"{__name__}.{_arch}")
    except Exception as _e:  # recorded and shown by explain(); the other arches still load
        IMPORT_ERRORS[_arch] = f"{type(_e).__name__}: {_e}"

if not _dispatch._REGISTRY["fast"] and IMPORT_ERRORS:
    raise ImportError("; ".join(f"{a}: {e}" for a, e in IMPORT_ERRORS.items()))
