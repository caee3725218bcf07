"""The arguments form: one ipywidget per parameter of a JSON schema, and back to JSON data.

Strings are text fields, integers and numbers numeric fields (bounded where the schema has
``minimum``/``maximum``), booleans checkboxes, ``enum`` a dropdown; objects, arrays, unions and
anything else are JSON editors. A field shows its description, its required mark and its
problem (invalid JSON, or what the schema says is wrong) right under it. The widgets hold the
values: :meth:`SchemaForm.read` reads them, :meth:`SchemaForm.fill` writes them.
"""

from __future__ import annotations

import html
import json
import math
import re
from typing import Any

import ipywidgets as w

from kernelexec._exceptions import ConfigError

UNSET: Any = object()
"""A field left empty: the argument stays out of the call."""
_STYLE = {"description_width": "12em"}
_WIDE = w.Layout(width="36em")


def css_class(name: str) -> str:
    """``name`` as one CSS class token: a class with a space (``"env vars"``) makes the
    browser's ``classList.add`` throw on every render."""
    return re.sub(r"[^A-Za-z0-9_-]", "-", name)


class FieldProblem(Exception):
    """What is wrong with a field's current value (shown next to it)."""


class Field:
    """One parameter: its input widget, help text and problem line.

    Attributes:
        name: The parameter's name.
        schema: The parameter's JSON schema.
        required: Whether the schema requires it.
        box: The widget to lay out (input, help, problem).
    """

    kind = "json"

    def __init__(self, name: str, schema: dict[str, Any], required: bool) -> None:
        self.name = name
        self.schema = schema
        self.required = required
        self.default = schema.get("default", UNSET)
        self.input = self._make_input(f"{name} *" if required else name)
        self.input.add_class(css_class(f"kx-field-{name}"))
        help_text = str(schema.get("description") or "")
        if self.default is not UNSET:
            help_text += f" (default: {json.dumps(self.default, ensure_ascii=False)})"
        if required:
            help_text = "<b>required.</b> " + html.escape(help_text)
        else:
            help_text = html.escape(help_text)
        self.help = w.HTML(f"<small>{help_text}</small>" if help_text.strip() else "")
        self.problem = w.HTML("")
        self.problem.add_class("kx-problem")
        for line in (self.help, self.problem):  # under the input, past its label
            line.layout.margin = "0 0 0 12.5em"
        self.box = w.VBox([self.input, self.help, self.problem])
        self.reset()

    # -- subclasses -------------------------------------------------------------------------

    def _make_input(self, label: str) -> w.ValueWidget:
        return w.Textarea(
            description=label,
            placeholder="JSON",
            rows=2,
            style=_STYLE,
            layout=_WIDE,
            continuous_update=False,
        )

    def _read(self) -> Any:
        """The value in the widget, or ``UNSET`` when the field is left empty."""
        text = str(self.input.value).strip()
        if not text:
            return UNSET
        try:
            return json.loads(text)
        except ValueError as exc:
            raise FieldProblem(f"invalid JSON: {exc}") from None

    def _write(self, value: Any) -> None:
        self.input.value = "" if value is UNSET else json.dumps(value, ensure_ascii=False)

    # -- shared -----------------------------------------------------------------------------

    def reset(self) -> None:
        """Back to the default (or empty)."""
        self._write(self.default)
        self.show_problem("")

    def read(self) -> Any:
        """The field's value as JSON data, ``UNSET`` if left out.

        Raises:
            FieldProblem: the value cannot be read (invalid JSON, a required field empty).
        """
        value = self._read()
        if value is UNSET and self.required:
            raise FieldProblem("required")
        return value

    def write(self, value: Any) -> None:
        """Put ``value`` in the widget.

        Raises:
            ConfigError: the widget cannot hold it (naming the field).
        """
        try:
            self._write(value)
        except (TypeError, ValueError) as exc:
            raise ConfigError(
                f"argument {self.name!r}: cannot put {value!r} in a {self.kind} field: {exc}"
            ) from None
        self.show_problem("")

    def show_problem(self, text: str) -> None:
        """Show ``text`` under the field (``""`` clears it)."""
        self.problem.value = (
            f'<span style="color:#c62828">&#9888; {html.escape(text, quote=False)}</span>'
            if text
            else ""
        )


class TextField(Field):
    kind = "text"

    def _make_input(self, label: str) -> w.ValueWidget:
        return w.Text(description=label, style=_STYLE, layout=_WIDE, continuous_update=False)

    def _read(self) -> Any:
        value = str(self.input.value)
        return UNSET if value == "" and not self.required and self.default is UNSET else value

    def _write(self, value: Any) -> None:
        if value is UNSET:
            value = ""
        if not isinstance(value, str):
            raise TypeError("not a string")
        self.input.value = value


class NumberField(Field):
    kind = "number"

    def _make_input(self, label: str) -> w.ValueWidget:
        integer = self.schema.get("type") == "integer"
        low, high = _bounds(self.schema, integer)
        kwargs: dict[str, Any] = {"description": label, "style": _STYLE, "continuous_update": False}
        if low is None and high is None:
            return w.IntText(**kwargs) if integer else w.FloatText(**kwargs)
        # Bounded widgets need both ends; a missing one is as far as the widget can go.
        if integer:
            return w.BoundedIntText(
                min=low if low is not None else -(2**31),
                max=high if high is not None else 2**31 - 1,
                **kwargs,
            )
        return w.BoundedFloatText(
            min=low if low is not None else -math.inf,
            max=high if high is not None else math.inf,
            **kwargs,
        )

    def _read(self) -> Any:
        return self.input.value

    def _write(self, value: Any) -> None:
        low, high = getattr(self.input, "min", None), getattr(self.input, "max", None)
        if value is UNSET:  # a required number starts at 0, or the nearest bound
            value = min(max(0, low if low is not None else 0), high if high is not None else 0)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError("not a number")
        if isinstance(self.input, (w.IntText, w.BoundedIntText)) and not float(value).is_integer():
            raise TypeError("not an integer")
        if (low is not None and value < low) or (high is not None and value > high):
            raise ValueError(f"outside [{low}, {high}]")
        self.input.value = value


class BoolField(Field):
    kind = "checkbox"

    def _make_input(self, label: str) -> w.ValueWidget:
        return w.Checkbox(description=label, indent=True, style=_STYLE)

    def _read(self) -> Any:
        return bool(self.input.value)

    def _write(self, value: Any) -> None:
        if value is UNSET:
            value = False
        if not isinstance(value, bool):
            raise TypeError("not a boolean")
        self.input.value = value


class EnumField(Field):
    kind = "dropdown"

    def _make_input(self, label: str) -> w.ValueWidget:
        self.choices = list(self.schema["enum"])
        options: list[tuple[str, int]] = [
            (c if isinstance(c, str) else json.dumps(c), i) for i, c in enumerate(self.choices)
        ]
        if not self.required and self.default is UNSET:
            options.insert(0, ("(not set)", -1))
        return w.Dropdown(description=label, options=options, style=_STYLE)

    def _read(self) -> Any:
        index = self.input.value
        return UNSET if index is None or index < 0 else self.choices[index]

    def _write(self, value: Any) -> None:
        if value is UNSET:
            self.input.value = self.input.options[0][1]
            return
        for i, choice in enumerate(self.choices):
            if choice == value and type(choice) is type(value):
                self.input.value = i
                return
        raise ValueError(f"not one of {self.choices!r}")


def _bounds(schema: dict[str, Any], integer: bool) -> tuple[float | None, float | None]:
    low = schema.get("minimum")
    high = schema.get("maximum")
    step = 1 if integer else 0
    if low is None and isinstance(schema.get("exclusiveMinimum"), (int, float)):
        low = schema["exclusiveMinimum"] + step
    if high is None and isinstance(schema.get("exclusiveMaximum"), (int, float)):
        high = schema["exclusiveMaximum"] - step
    return low, high


def make_field(name: str, schema: Any, required: bool) -> Field:
    """The field for one parameter's schema (a JSON editor when nothing else fits)."""
    if not isinstance(schema, dict):
        schema = {}
    has_default = "default" in schema
    kind = schema.get("type")
    if isinstance(schema.get("enum"), list) and schema["enum"]:
        return EnumField(name, schema, required)
    if kind == "string":
        return TextField(name, schema, required)
    # A numeric widget or a checkbox always holds a value; an optional parameter without a
    # default must be able to stay out of the call, so it gets a JSON editor instead.
    if not required and not has_default:
        return Field(name, schema, required)
    if kind in ("integer", "number") and _numeric_default(schema):
        return NumberField(name, schema, required)
    if kind == "boolean" and isinstance(schema.get("default", False), bool):
        return BoolField(name, schema, required)
    return Field(name, schema, required)


def _numeric_default(schema: dict[str, Any]) -> bool:
    default = schema.get("default", 0)
    return isinstance(default, (int, float)) and not isinstance(default, bool)


_NAMED = re.compile(r"argument '([^'.]+)")


class SchemaForm(w.VBox):
    """A form for the ``properties`` of an object schema (a tool's parameters).

    Args:
        schema: A JSON schema of type object.
    """

    def __init__(self, schema: dict[str, Any]) -> None:
        props = schema.get("properties") or {}
        required = set(schema.get("required") or [])
        self.fields = {name: make_field(name, sub, name in required) for name, sub in props.items()}
        self.general = w.HTML("")
        self.general.add_class("kx-problem")
        super().__init__([*(f.box for f in self.fields.values()), self.general])

    def read(self) -> tuple[dict[str, Any], dict[str, str]]:
        """The arguments the form holds, and the problems by field name (empty when none)."""
        args: dict[str, Any] = {}
        problems: dict[str, str] = {}
        for name, field in self.fields.items():
            try:
                value = field.read()
            except FieldProblem as exc:
                problems[name] = str(exc)
                continue
            if value is not UNSET:
                args[name] = value
        return args, problems

    def fill(self, args: dict[str, Any]) -> None:
        """Set every field: those in ``args`` to their value, the others to their default.

        Raises:
            ConfigError: ``args`` names a parameter the schema does not have, or a value the
                field cannot hold (nothing is changed then).
        """
        if not isinstance(args, dict):
            raise ConfigError(f"arguments must be a dict, not {type(args).__name__}")
        unknown = sorted(set(args) - set(self.fields))
        if unknown:
            known = ", ".join(self.fields) or "none"
            raise ConfigError(
                f"unknown argument(s) {', '.join(map(repr, unknown))} (parameters: {known})"
            )
        before = {name: f.input.value for name, f in self.fields.items()}
        try:
            for name, field in self.fields.items():
                if name in args:
                    field.write(args[name])
                else:
                    field.reset()
        except ConfigError:
            for name, field in self.fields.items():
                field.input.value = before[name]
            raise
        self.show_problems({})

    def show_problems(self, problems: dict[str, str], general: list[str] | None = None) -> None:
        """Show each field's problem under it; problems naming no field go below the form."""
        for name, field in self.fields.items():
            field.show_problem(problems.get(name, ""))
        text = "; ".join(general or [])
        self.general.value = (
            f'<span style="color:#c62828">&#9888; {html.escape(text, quote=False)}</span>'
            if text
            else ""
        )

    def show_schema_problems(self, messages: list[str]) -> None:
        """Put the schema validator's messages next to the fields they name."""
        by_field: dict[str, list[str]] = {}
        general: list[str] = []
        for message in messages:
            match = _NAMED.search(message)
            if match and match.group(1) in self.fields:
                by_field.setdefault(match.group(1), []).append(message)
            else:
                general.append(message)
        self.show_problems({k: "; ".join(v) for k, v in by_field.items()}, general)
