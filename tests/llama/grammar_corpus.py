"""Grammars and schemas with an independent checker each (Python's json/jsonschema, re, or a small recursive-descent
parser written here), shared by the grammar tests of the API, the CLI and the server. Sizes are bounded so that a
sampled reply ends well within the tests' token budgets."""
from __future__ import annotations

import json
import re

# ------------------------------------------------------------------------------------------------ GBNF


def _json_like(text: str) -> bool:
    v = json.loads(text)
    if not isinstance(v, dict) or len(v) > 3:
        return False
    for val in v.values():
        if isinstance(val, list):
            if len(val) > 3 or not all(isinstance(x, (str, int, float)) and not isinstance(x, bool) for x in val):
                return False
        elif not (val is None or isinstance(val, (str, int, float, bool))):
            return False
    return True


class _Arith:
    """expr := term (('+'|'-') term)* ; term := factor (('*'|'/') factor)* ; factor := num | '(' expr ')'."""

    def __init__(self, s):
        self.s, self.i = s, 0

    def peek(self):
        return self.s[self.i] if self.i < len(self.s) else ""

    def expr(self):
        self.term()
        while self.peek() in ("+", "-") and self.peek():
            self.i += 1
            self.term()

    def term(self):
        self.factor()
        while self.peek() in ("*", "/") and self.peek():
            self.i += 1
            self.factor()

    def factor(self):
        if self.peek() == "(":
            self.i += 1
            self.expr()
            assert self.peek() == ")", f"')' expected at {self.i}"
            self.i += 1
            return
        j = self.i
        while self.peek().isdigit():
            self.i += 1
        assert 1 <= self.i - j <= 3, f"a number of 1-3 digits expected at {j}"


def _arith(text: str) -> bool:
    assert text.endswith("="), "ends with '='"
    p = _Arith(text[:-1])
    p.expr()
    return p.i == len(text) - 1


_IDENT = r"[a-z][a-z0-9_]{0,5}"
_CEXPR = rf"(?:{_IDENT}|[0-9]{{1,3}})(?: [-+*<] (?:{_IDENT}|[0-9]{{1,3}})){{0,2}}"


def _c_like(text: str) -> bool:
    """Statements one per line: assignment, if with one assignment inside, return; `return` only last."""
    lines = text.split("\n")
    if lines[-1] != "" or not 1 <= len(lines) - 1 <= 3:
        return False
    stmts = lines[:-1]
    for k, st in enumerate(stmts):
        if re.fullmatch(rf"(?:int )?{_IDENT} = {_CEXPR};", st):
            continue
        if re.fullmatch(rf"if \({_CEXPR}\) {{ {_IDENT} = {_CEXPR}; }}", st):
            continue
        if re.fullmatch(rf"return {_CEXPR};", st) and k == len(stmts) - 1:
            continue
        return False
    return True


_SAN = re.compile(r"(?:O-O(?:-O)?|[KQRBN][a-h]?[1-8]?x?[a-h][1-8]|[a-h](?:x[a-h])?[1-8](?:=[QRBN])?)[+#]?")


def _chess(text: str) -> bool:
    moves = text.split(" ")
    return 3 <= len(moves) <= 5 and all(_SAN.fullmatch(m) for m in moves)


def _non_ascii(text: str) -> bool:
    return re.fullmatch(r"(?:Привет|こんにちは|Grüß dich|你好), [а-яё]{2,6}!", text) is not None


def _kitchen(text: str) -> bool:
    return re.fullmatch(r'(?:[a-z]{1,6}=(?:"[^"\n\\]{0,8}"|[0-9]{1,4}|\.[^\n]{1,3})\n){1,3}', text) is not None


def _list(text: str) -> bool:
    return re.fullmatch(r"(?:- [A-Z][a-z]{1,8}(?: [a-z]{1,6})?\n){2,4}", text) is not None


# name -> (GBNF, prompt, checker)
GBNF = {
    "json_like": (r'''
root   ::= "{" ( pair ( ", " pair ){0,2} )? "}"
pair   ::= string ": " value
value  ::= string | number | "true" | "false" | "null" | array
array  ::= "[" ( scalar ( ", " scalar ){0,2} )? "]"
scalar ::= string | number
string ::= "\"" [a-zA-Z0-9 _]{0,8} "\""
number ::= "-"? [0-9]{1,3} ( "." [0-9]{1,2} )?
''', "Describe a cat as a JSON object.", _json_like),
    "arithmetic": (r'''
root   ::= expr "="
expr   ::= term ( [-+] term ){0,2}
term   ::= factor ( [*/] factor ){0,1}
factor ::= [0-9]{1,3} | "(" [0-9]{1,3} [-+*/] [0-9]{1,3} ")"
''', "Write an arithmetic expression.", _arith),
    "list": (r'''
root ::= item{2,4}
item ::= "- " [A-Z] [a-z]{1,8} ( " " [a-z]{1,6} )? "\n"
''', "List some fruits.", _list),
    "c_like": (r'''
root   ::= stmt{0,2} last
stmt   ::= assign | ifst
last   ::= assign | ifst | "return " expr ";\n"
assign ::= ( "int " )? ident " = " expr ";\n"
ifst   ::= "if (" expr ") { " ident " = " expr "; }\n"
expr   ::= operand ( " " [-+*<] " " operand ){0,2}
operand ::= ident | [0-9]{1,3}
ident  ::= [a-z] [a-z0-9_]{0,5}
''', "Write a few lines of C code.", _c_like),
    "chess": (r'''
# standard algebraic notation, three to five moves
root   ::= move ( " " move ){2,4}
move   ::= ( castle | piece | pawn ) check?
castle ::= "O-O" "-O"?
piece  ::= [KQRBN] [a-h]? [1-8]? "x"? [a-h] [1-8]
pawn   ::= [a-h] ( "x" [a-h] )? [1-8] ( "=" [QRBN] )?
check  ::= [+#]
''', "Give the first chess moves of a game.", _chess),
    "non_ascii": ('''
root ::= greeting ", " [\\u0430-\\u044f\\u0451]{2,6} "!"
greeting ::= "Привет" | "こんにちは" | "Gr\\u00fc\\u00df dich" | "你好"
''', "Greet someone in another language.", _non_ascii),
    "kitchen_sink": (r'''
# comments, negated classes, '.', escapes, repetition ranges
root  ::= line{1,3}
line  ::= key "=" value "\n"   # one setting per line
key   ::= [a-z]{1,6}
value ::= "\"" [^"\n\\]{0,8} "\"" | [0-9]{1,4} | "\x2e" .{1,3}
''', "Write a config file.", _kitchen),
}

# ------------------------------------------------------------------------------------------------ JSON schema
SCHEMAS = {
    "types": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}, "tall": {"type": "boolean"},
        "height": {"type": "number"}, "nick": {"type": "null"}},
        "required": ["name", "age", "tall", "height", "nick"], "additionalProperties": False},
    "enum_const": {"type": "object", "properties": {
        "color": {"enum": ["red", "green", "blue"]}, "kind": {"const": "pet"}, "size": {"enum": [1, 2, 3, None]}},
        "required": ["color", "kind", "size"], "additionalProperties": False},
    "required_optional": {"type": "object", "properties": {
        "id": {"type": "integer"}, "tag": {"type": "string", "maxLength": 6}},
        "required": ["id"], "additionalProperties": False},
    "array_items": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99},
                    "minItems": 2, "maxItems": 4},
    "string_lengths": {"type": "object", "properties": {
        "code": {"type": "string", "minLength": 3, "maxLength": 5},
        "word": {"type": "string", "minLength": 1, "maxLength": 8}},
        "required": ["code", "word"], "additionalProperties": False},
    "numeric_bounds": {"type": "object", "properties": {
        "pct": {"type": "integer", "minimum": 0, "maximum": 100},
        "temp": {"type": "number", "minimum": -10.5, "maximum": 40, "exclusiveMaximum": 40},
        "odd": {"type": "integer", "exclusiveMinimum": 5, "maximum": 9}},
        "required": ["pct", "temp", "odd"], "additionalProperties": False},
    "any_of": {"type": "object", "properties": {
        "value": {"anyOf": [{"type": "integer"}, {"type": "string", "maxLength": 6}, {"type": "boolean"}]}},
        "required": ["value"], "additionalProperties": False},
    "ref_defs": {"$defs": {"point": {"type": "object", "properties": {
        "x": {"type": "integer", "minimum": -9, "maximum": 9}, "y": {"type": "integer", "minimum": -9, "maximum": 9}},
        "required": ["x", "y"], "additionalProperties": False}},
        "type": "object", "properties": {"a": {"$ref": "#/$defs/point"}, "b": {"$ref": "#/$defs/point"}},
        "required": ["a", "b"], "additionalProperties": False},
    "pattern": {"type": "object", "properties": {
        "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
        "sku": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{2,3}$"}},
        "required": ["zip", "sku"], "additionalProperties": False},
    "nested": {"type": "object", "properties": {
        "user": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                                  "roles": {"type": "array", "items": {"enum": ["admin", "dev"]},
                                                            "maxItems": 2}},
                 "required": ["name", "roles"], "additionalProperties": False}},
        "required": ["user"], "additionalProperties": False},
    "one_of_format": {"type": "object", "properties": {
        "when": {"type": "string", "format": "date"},
        "id": {"oneOf": [{"type": "integer", "minimum": 0, "maximum": 9}, {"type": "null"}]}},
        "required": ["when", "id"], "additionalProperties": False},
}

SCHEMA_PROMPT = "Reply with a JSON object."

BAD_GBNF = {
    "undefined_rule": 'root ::= "a" | foo',
    "unterminated": 'root ::= "a',
    "no_root": 'start ::= "a"',
    "bad_class": 'root ::= [z-a]',
    "bad_escape": r'root ::= "\q"',
}
BAD_SCHEMAS = {
    "unknown_type": {"type": "foo"},
    "bad_pattern": {"type": "string", "pattern": "[a-"},
    "dangling_ref": {"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}},
    "unsupported_keyword": {"type": "array", "uniqueItems": True},
}


def check_schema(schema: dict, text: str) -> None:
    import jsonschema
    jsonschema.validate(json.loads(text), schema, format_checker=jsonschema.FormatChecker())
