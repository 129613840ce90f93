"""Every public callable of the public API carries full type hints (longdoc ships py.typed, and the API reference
in the docs shows these signatures). `make lint` runs mypy on tests/typing/public_api.py for the types themselves;
this test catches a new public function or method that lands without annotations, which mypy would silently take
as Any."""

from __future__ import annotations

import inspect

import pytest

import longdoc
import longdoc.hf
import longdoc.parallel.api
import longdoc.parallel.layout

# The public surface: the package fronts' __all__, and the names the docs teach from longdoc.parallel.
PUBLIC = {
    "longdoc": (longdoc, list(longdoc.__all__)),
    "longdoc.hf": (longdoc.hf, list(longdoc.hf.__all__)),
    "longdoc.parallel.api": (longdoc.parallel.api, ["ContextParallel", "attention", "check_strategy"]),
    "longdoc.parallel.layout": (longdoc.parallel.layout, ["Packed", "Branches"]),
}
SKIP_METHODS = {"__repr__", "__enter__", "__exit__"}


def _overrides_trainer(attr: str) -> bool:
    # CPTrainerMixin's overrides of transformers.Trainer methods keep the Trainer's own (partly unannotated) contract.
    from transformers import Trainer

    return attr != "__init__" and hasattr(Trainer, attr)


def _callables() -> list[tuple[str, object]]:
    out = []
    for modname, (mod, names) in PUBLIC.items():
        for name in names:
            obj = getattr(mod, name)
            if inspect.isclass(obj):
                if issubclass(obj, Exception):
                    continue
                for attr, member in vars(obj).items():
                    if attr.startswith("_") and attr != "__init__" or attr in SKIP_METHODS or (
                            name.startswith("CPTrainer") and _overrides_trainer(attr)):
                        continue
                    if isinstance(member, (staticmethod, classmethod)):
                        member = member.__func__
                    if isinstance(member, property):
                        member = member.fget
                    if inspect.isfunction(member):
                        out.append((f"{modname}.{name}.{attr}", member))
            elif callable(obj):
                out.append((f"{modname}.{name}", obj))
    return out


CALLABLES = _callables()


def test_public_surface_is_found():
    names = {n for n, _ in CALLABLES}
    # A refactor that hides the surface from this test (lazy imports, renames) must not pass silently.
    for expected in ("longdoc.attention", "longdoc.patch", "longdoc.ContextParallel.__init__",
                     "longdoc.ContextParallel.shard_batch", "longdoc.hf.KVSession.prefill", "longdoc.hf.generate",
                     "longdoc.hf.CPTrainerMixin.__init__", "longdoc.parallel.layout.Packed.from_position_ids"):
        assert expected in names, (expected, sorted(names))


@pytest.mark.parametrize("name,fn", CALLABLES, ids=[n for n, _ in CALLABLES])
def test_fully_annotated(name, fn):
    sig = inspect.signature(fn)
    missing = [p.name for i, p in enumerate(sig.parameters.values())
               if p.annotation is inspect.Parameter.empty and not (i == 0 and p.name in ("self", "cls"))]
    assert not missing, f"{name}: parameters without a type hint: {missing}"
    assert sig.return_annotation is not inspect.Signature.empty, f"{name}: no return type hint"
