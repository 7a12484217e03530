"""A griffe extension: show `-> UniformReplay` where the source says `-> _U`.

Methods that return a new module are annotated with a private TypeVar bound to their class
(`def add(self: _U, ...) -> _U`), so that beartype checks them and pyright infers the concrete
type. In rendered signatures the TypeVar's name means nothing to a reader: this replaces it with
the name of the class that defines the method.
"""

import dataclasses

import griffe


class SelfTypes(griffe.Extension):
    def on_package(self, *, pkg: griffe.Module, **kwargs) -> None:
        for module in _modules(pkg):
            typevars = {
                name
                for name, member in module.members.items()
                if not member.is_alias
                and member.is_attribute
                and str(getattr(member, "value", "")).startswith("TypeVar(")
            }
            for cls in module.classes.values():
                for func in cls.functions.values():
                    if typevars and func.returns is not None:
                        func.returns = _replace(func.returns, typevars, cls)


def _modules(module: griffe.Module):
    yield module
    for sub in module.modules.values():
        if not sub.is_alias:
            yield from _modules(sub)


def _replace(expr, typevars: set[str], cls: griffe.Class):
    if isinstance(expr, griffe.ExprName):
        return griffe.ExprName(cls.name, parent=cls.parent) if expr.name in typevars else expr
    if isinstance(expr, griffe.Expr):
        for field in dataclasses.fields(expr):
            value = getattr(expr, field.name)
            if isinstance(value, list):
                value = [_replace(v, typevars, cls) for v in value]
            else:
                value = _replace(value, typevars, cls)
            setattr(expr, field.name, value)
    return expr
