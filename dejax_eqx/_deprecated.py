"""The deprecated forms of the public API, in one place: each still works for one release,
with a `DeprecationWarning` that says what replaces it (see `CHANGELOG.md`)."""

import warnings
from collections.abc import Callable
from typing import Any


def as_options(value: Any, options: dict[str, Any], cls: type[Any], call: str, old: str) -> Any:
    """`value` if it is a `cls` (an options object such as `dx.Window`) and no `options` came
    with it. For one release, the old form, `old` (an int and keyword `options`), is turned
    into `cls(value, **options)` with a `DeprecationWarning`."""
    name = cls.__name__
    if isinstance(value, cls):
        if options:
            raise TypeError(
                f"`{call}`: {sorted(options)} are options of the `{name}`; pass them to "
                f"`dx.{name}(...)`, not here."
            )
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        warnings.warn(
            f"`{call}`: {old} is deprecated; pass `dx.{name}({value}, ...)` with the options "
            "instead (removed in the next release).",
            DeprecationWarning,
            stacklevel=4,
        )
        return cls(value, **options)
    raise TypeError(f"`{call}`: expected a `dx.{name}`, got {value!r}.")


def deprecated_property(owner: str, old: str, new: str, get: Callable[[Any], Any]) -> property:
    """A read-only property `old` of class `owner` that warns (`DeprecationWarning`) and returns
    `get(self)`, what `new` reads now."""

    def read(self: Any) -> Any:
        warnings.warn(
            f"`{owner}.{old}` is deprecated; read `{new}` (the same; removed in the next release).",
            DeprecationWarning,
            stacklevel=2,
        )
        return get(self)

    return property(read, doc=f"Deprecated: `{new}` under its old name.")


def renamed(new_value: Any, old_value: Any, new: str, old: str, call: str) -> Any:
    """The value of an argument that was renamed from `old` to `new`: `old_value` (with a
    `DeprecationWarning`) if only the old name was given, else `new_value`."""
    if old_value is None:
        return new_value
    if new_value is not None:
        raise TypeError(f"`{call}`: pass `{new}` only (`{old}` is its deprecated name).")
    warnings.warn(
        f"`{call}({old}=...)` is deprecated; pass `{new}=...` (the same; removed in the next "
        "release).",
        DeprecationWarning,
        stacklevel=3,
    )
    return old_value


def warn_replaced(old: str, new: str, *, stacklevel: int = 3) -> None:
    """Warn that `old` (a call or a name) is deprecated in favour of `new`."""
    warnings.warn(
        f"`{old}` is deprecated; use `{new}` (removed in the next release).",
        DeprecationWarning,
        stacklevel=stacklevel,
    )
