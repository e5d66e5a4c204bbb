"""A tiny validator that is also a JSON Schema: one definition per request field.

Each spec both checks a value (raising a 400 that names the field, OpenAI's
``param``) and describes itself as JSON Schema for ``/openapi.json``, so the
documented API and the enforced one cannot drift. ``null`` means "not given" for
every optional field, as in OpenAI's API. A field no spec defines is a 400
naming it (OpenAI's "Unrecognized request argument"), so a client never
believes it got something the server silently dropped; a lenient object (the
``--lenient-fields`` server flag) logs a warning instead.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any

from aiolm.server.errors import APIError, bad_request

log = logging.getLogger("aiolm.server")


def _type_name(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, int):
        return "integer"
    if isinstance(v, float):
        return "number"
    if isinstance(v, str):
        return "string"
    if isinstance(v, list):
        return "array"
    if isinstance(v, dict):
        return "object"
    return type(v).__name__


class Spec:
    """Base: ``parse`` returns the clean value or raises; ``schema`` documents it."""

    what = "a value"

    def parse(self, value: Any, name: str) -> Any:
        raise NotImplementedError

    def schema(self) -> dict[str, Any]:
        raise NotImplementedError

    def fail(self, value: Any, name: str, detail: str = "") -> Exception:
        got = _type_name(value) if not detail else detail
        return bad_request(f"'{name}' must be {self.what}, got {got}", param=name)


@dataclass
class Int(Spec):
    ge: int | None = None
    le: int | None = None

    @property
    def what(self) -> str:  # type: ignore[override]
        if self.ge is not None and self.le is not None:
            return f"an integer in [{self.ge}, {self.le}]"
        if self.ge is not None:
            return f"an integer >= {self.ge}"
        if self.le is not None:
            return f"an integer <= {self.le}"
        return "an integer"

    def parse(self, value: Any, name: str) -> int:
        if isinstance(value, float) and math.isfinite(value) and value.is_integer():
            value = int(value)
        if not isinstance(value, int) or isinstance(value, bool):
            raise self.fail(value, name)
        if (self.ge is not None and value < self.ge) or (self.le is not None and value > self.le):
            raise self.fail(value, name, str(value))
        return value

    def schema(self) -> dict[str, Any]:
        s: dict[str, Any] = {"type": "integer"}
        if self.ge is not None:
            s["minimum"] = self.ge
        if self.le is not None:
            s["maximum"] = self.le
        return s


@dataclass
class Num(Spec):
    ge: float | None = None
    le: float | None = None
    gt: float | None = None

    @property
    def what(self) -> str:  # type: ignore[override]
        lo = f"> {self.gt}" if self.gt is not None else (f">= {self.ge}" if self.ge is not None else "")
        if lo and self.le is not None:
            lo_b = "(" if self.gt is not None else "["
            lo_v = self.gt if self.gt is not None else self.ge
            return f"a number in {lo_b}{lo_v}, {self.le}]"
        if lo:
            return f"a number {lo}"
        return f"a number <= {self.le}" if self.le is not None else "a finite number"

    def parse(self, value: Any, name: str) -> float:
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise self.fail(value, name)
        v = float(value) if isinstance(value, float) or abs(value) < 2**53 else math.inf
        if not math.isfinite(v):
            raise self.fail(value, name, repr(value))
        if ((self.ge is not None and v < self.ge) or (self.gt is not None and v <= self.gt)
                or (self.le is not None and v > self.le)):
            raise self.fail(value, name, repr(value))
        return v

    def schema(self) -> dict[str, Any]:
        s: dict[str, Any] = {"type": "number"}
        if self.ge is not None:
            s["minimum"] = self.ge
        if self.gt is not None:
            s["exclusiveMinimum"] = self.gt
        if self.le is not None:
            s["maximum"] = self.le
        return s


class Bool(Spec):
    what = "a boolean"

    def parse(self, value: Any, name: str) -> bool:
        if not isinstance(value, bool):
            raise self.fail(value, name)
        return value

    def schema(self) -> dict[str, Any]:
        return {"type": "boolean"}


@dataclass
class Str(Spec):
    min_len: int = 0
    max_len: int | None = None

    @property
    def what(self) -> str:  # type: ignore[override]
        return "a non-empty string" if self.min_len else "a string"

    def parse(self, value: Any, name: str) -> str:
        if not isinstance(value, str):
            raise self.fail(value, name)
        if len(value) < self.min_len:
            raise self.fail(value, name, "an empty string")
        if self.max_len is not None and len(value) > self.max_len:
            raise bad_request(f"'{name}' is longer than {self.max_len} characters", param=name)
        return value

    def schema(self) -> dict[str, Any]:
        s: dict[str, Any] = {"type": "string"}
        if self.min_len:
            s["minLength"] = self.min_len
        if self.max_len is not None:
            s["maxLength"] = self.max_len
        return s


@dataclass
class Enum(Spec):
    values: tuple[str, ...]

    @property
    def what(self) -> str:  # type: ignore[override]
        return "one of " + ", ".join(repr(v) for v in self.values)

    def parse(self, value: Any, name: str) -> str:
        if value not in self.values or not isinstance(value, str):
            raise self.fail(value, name, repr(value) if isinstance(value, str) else "")
        return value

    def schema(self) -> dict[str, Any]:
        return {"type": "string", "enum": list(self.values)}


@dataclass
class ListOf(Spec):
    item: Spec
    min_items: int = 0
    max_items: int | None = None

    @property
    def what(self) -> str:  # type: ignore[override]
        return f"a list (each item {self.item.what})"

    def parse(self, value: Any, name: str) -> list[Any]:
        if not isinstance(value, list):
            raise self.fail(value, name)
        if len(value) < self.min_items:
            raise bad_request(f"'{name}' must have at least {self.min_items} item(s)", param=name)
        if self.max_items is not None and len(value) > self.max_items:
            raise bad_request(f"'{name}' must have at most {self.max_items} items, got {len(value)}", param=name)
        return [self.item.parse(v, f"{name}[{i}]") for i, v in enumerate(value)]

    def schema(self) -> dict[str, Any]:
        s: dict[str, Any] = {"type": "array", "items": self.item.schema()}
        if self.min_items:
            s["minItems"] = self.min_items
        if self.max_items is not None:
            s["maxItems"] = self.max_items
        return s


@dataclass
class MapOf(Spec):
    value: Spec
    max_items: int | None = None
    what = "an object"

    def parse(self, value: Any, name: str) -> dict[str, Any]:
        if not isinstance(value, dict):
            raise self.fail(value, name)
        if self.max_items is not None and len(value) > self.max_items:
            raise bad_request(f"'{name}' must have at most {self.max_items} entries", param=name)
        return {k: self.value.parse(v, name) for k, v in value.items()}

    def schema(self) -> dict[str, Any]:
        s: dict[str, Any] = {"type": "object", "additionalProperties": self.value.schema()}
        if self.max_items is not None:
            s["maxProperties"] = self.max_items
        return s


class OneOf(Spec):
    """The first alternative that accepts the value wins; errors name all of them."""

    def __init__(self, *alternatives: Spec, what: str | None = None) -> None:
        self.alternatives = alternatives
        self.what = what or " or ".join(a.what for a in alternatives)

    def parse(self, value: Any, name: str) -> Any:
        matching = [a for a in self.alternatives if _matches_type(a, value)]
        if len(matching) == 1:  # only one shape fits the JSON type: its error is the precise one
            return matching[0].parse(value, name)
        for alt in matching:
            try:
                return alt.parse(value, name)
            except APIError:
                continue
        if isinstance(value, list) and not value:
            raise bad_request(f"'{name}' is an empty list; it must be {self.what}", param=name)
        raise self.fail(value, name)

    def schema(self) -> dict[str, Any]:
        return {"anyOf": [a.schema() for a in self.alternatives]}


def _matches_type(spec: Spec, value: Any) -> bool:
    if isinstance(spec, ListOf) and isinstance(value, list) and value:
        return _matches_type(spec.item, value[0])  # a list's shape is told by its first item
    kinds = {Int: int, Num: (int, float), Bool: bool, Str: str, Enum: str, ListOf: list, MapOf: dict, Obj: dict}
    for cls, typ in kinds.items():
        if isinstance(spec, cls):
            if isinstance(value, bool) and cls is not Bool:
                return False
            return isinstance(value, typ)  # type: ignore[arg-type]
    return False


@dataclass
class Field:
    spec: Spec
    required: bool = False
    default: Any = None
    doc: str = ""


class Obj(Spec):
    """An object with known fields; an unknown one is a 400 naming it (a warning if ``lenient``)."""

    what = "an object"

    def __init__(self, fields: dict[str, Field], lenient: bool = False) -> None:
        self.fields = fields
        self.lenient = lenient

    def _check_unknown(self, value: dict[str, Any], name: str) -> None:
        unknown = [k for k in value if k not in self.fields]
        if not unknown:
            return
        paths = [f"{name}.{k}" if name else k for k in unknown]
        listed = ", ".join(repr(p) for p in paths)
        if self.lenient:
            log.warning("ignoring request fields this server does not implement: %s", listed)
            return
        raise bad_request(f"Unrecognized request argument supplied: {listed} (this server does not "
                          f"implement {'it' if len(paths) == 1 else 'them'})",
                          param=paths[0], code="unrecognized_argument")

    def parse(self, value: Any, name: str = "") -> dict[str, Any]:
        if not isinstance(value, dict):
            if not name:
                raise bad_request(f"the request body must be a JSON object, got {_type_name(value)}")
            raise self.fail(value, name)
        self._check_unknown(value, name)
        out: dict[str, Any] = {}
        for key, f in self.fields.items():
            path = f"{name}.{key}" if name else key
            v = value.get(key)
            if v is None:
                if f.required:
                    raise bad_request(f"'{path}' is required", param=path, code="missing_required_parameter")
                out[key] = f.default
            else:
                out[key] = f.spec.parse(v, path)
        return out

    def schema(self) -> dict[str, Any]:
        props = {}
        for key, f in self.fields.items():
            s = dict(f.spec.schema())
            if not f.required:
                s = {"anyOf": [s, {"type": "null"}]} if "anyOf" not in s else {"anyOf": [*s["anyOf"], {"type": "null"}]}
            if f.doc:
                s["description"] = f.doc
            if f.default is not None:
                s["default"] = f.default
            props[key] = s
        out: dict[str, Any] = {"type": "object", "properties": props}
        if not self.lenient:
            out["additionalProperties"] = False
        req = [k for k, f in self.fields.items() if f.required]
        if req:
            out["required"] = req
        return out
