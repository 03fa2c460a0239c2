"""The bounds a constraint must keep before llguidance sees it (StructuredOutputsConfig's
limits): a JSON schema's nesting, its chain of levels and `$ref`s, its properties and
alternatives; a Lark or GBNF grammar's rules, rule chain, alternatives, and whether it can end
at all. Everything here is a loop over the input: nothing recurses along what a client wrote.

These run in the grammar compiler's process (server/grammar_compiler.py), before the compile;
`Refused` carries the message of the 400.
"""
from __future__ import annotations

import re
from typing import Any, Iterator

from ringserve.server.config import StructuredOutputsConfig
from ringserve.server.json_text import TooDeep, check_depth


class Refused(ValueError):
    """A constraint over a limit, or one that cannot work; the message names field and flag."""


def over(param: str, what: str, got: int, limit: int, flag: str) -> Refused:
    return Refused(f"{param} has {got} {what}, more than the limit {limit} (--{flag})")


# --- JSON schemas ------------------------------------------------------------------------------

_ITEM_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems", "enum")
_ITEM_MAPS = ("properties", "patternProperties", "$defs", "definitions")


def check_schema(schema: Any, param: str, cfg: StructuredOutputsConfig) -> None:
    """Nesting, properties + alternatives, and the longest chain of levels and `$ref`s."""
    try:
        check_depth(schema, cfg.max_json_depth, param)
    except TooDeep as e:
        raise Refused(str(e)) from None
    items = sum(_schema_items(node) for node in _containers(schema) if isinstance(node, dict))
    if items > cfg.max_grammar_items:
        raise over(param, "properties and alternatives", items, cfg.max_grammar_items,
                   "max-grammar-items")
    chain = longest_chain(schema, lambda node: _schema_edges(node, schema), cfg.max_grammar_depth)
    if chain > cfg.max_grammar_depth:
        raise Refused(f"{param} has a chain of more than {cfg.max_grammar_depth} levels and "
                      f"$refs in a row, more than the limit (--max-grammar-depth)")


def _schema_items(node: dict) -> int:
    n = 0
    for key in _ITEM_LISTS:
        if isinstance(node.get(key), list):
            n += len(node[key])
    for key in _ITEM_MAPS:
        if isinstance(node.get(key), dict):
            n += len(node[key])
    return n


def _containers(value: Any) -> Iterator[Any]:
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, (dict, list)):
            yield v
            stack.extend(v.values() if isinstance(v, dict) else v)


def _schema_edges(node: Any, root: Any) -> list[Any]:
    children = node.values() if isinstance(node, dict) else node
    out = [c for c in children if isinstance(c, (dict, list))]
    if isinstance(node, dict) and isinstance(node.get("$ref"), str):
        target = resolve_pointer(root, node["$ref"])
        if target is not None:
            out.append(target)
    return out


def resolve_pointer(root: Any, ref: str) -> Any:
    """The container a local `$ref` ("#", "#/$defs/a/...") points at, or None."""
    if ref == "#":
        return root
    if not ref.startswith("#/"):
        return None
    node = root
    for part in ref[2:].split("/"):
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node if isinstance(node, (dict, list)) else None


def longest_chain(root: Any, edges, limit: int) -> int:
    """The longest path from `root` through `edges` (cycles cut where a path meets itself, as a
    depth-first compiler meets them), counted in nodes; stops early past `limit`. Iterative."""
    memo: dict[int, int] = {}
    on_path = {id(root)}
    stack: list[list] = [[root, iter(edges(root)), 0]]
    while stack:
        if len(stack) > limit:
            return len(stack)
        top = stack[-1]
        child = next(top[1], None)
        if child is None:
            stack.pop()
            on_path.discard(id(top[0]))
            d = memo[id(top[0])] = top[2] + 1
            if d > limit:
                return d
            if stack:
                stack[-1][2] = max(stack[-1][2], d)
            continue
        key = id(child)
        if key in memo:
            top[2] = max(top[2], memo[key])
        elif key not in on_path:
            on_path.add(key)
            stack.append([child, iter(edges(child)), 0])
    return memo[id(root)]


# --- Lark and GBNF grammars ----------------------------------------------------------------

def is_lark(text: str) -> bool:
    """llguidance's own test (gbnf_to_lark.is_lark_syntax): anything else is GBNF."""
    return re.search(r"(?m)^\s*(%llguidance\b|start\s*:)", text) is not None


_COMMON = r"""
 (?P<nl>\n)
|(?P<ws>[ \t\r\f\v]+)
|(?P<string>"(?:[^"\\\n]|\\.)*"i?|'(?:[^'\\\n]|\\.)*'i?)
|(?P<special><\[[^\]\n]*\]>|<\|[^|\n]*\|>)
|(?P<directive>%[A-Za-z_]+)
|(?P<num>\d+)
"""
_LARK = re.compile(_COMMON + r"""
|(?P<comment>//[^\n]*)
|(?P<atom>/(?:[^/\\\n]|\\.)+/[a-z]*)
|(?P<name>[?!]?@?[A-Za-z_][A-Za-z0-9_]*)
|(?P<op>->|\.\.|[:|()\[\]?*+~{},.])
|(?P<other>.)
""", re.X | re.S)
_GBNF = re.compile(_COMMON + r"""
|(?P<comment>\#[^\n]*)
|(?P<atom>\[(?:[^\]\\\n]|\\.)*\]|\.)
|(?P<name>[A-Za-z_][A-Za-z0-9_-]*)
|(?P<op>::=|[|()?*+{},])
|(?P<other>.)
""", re.X | re.S)


class _Rule:
    __slots__ = ("name", "body", "refs")

    def __init__(self, name: str):
        self.name = name
        self.body: list[tuple[str, str]] = []
        self.refs: list[str] = []


def _rules(text: str, lark: bool) -> list[_Rule]:
    """The grammar's rules (and terminals), each with its body's tokens; directives' lines
    are skipped (an %import'ed name is defined elsewhere)."""
    tokens = [(m.lastgroup or "other", m.group()) for m in (_LARK if lark else _GBNF).finditer(text)]
    tokens = [t for t in tokens if t[0] not in ("ws", "comment")]
    rules: list[_Rule] = []
    current: _Rule | None = None
    line_start, i = True, 0
    while i < len(tokens):
        kind, tok = tokens[i]
        if kind == "nl":
            line_start, i = True, i + 1
            continue
        if line_start and kind == "directive" and tok != "%json":
            current = None  # %import, %ignore, %llguidance ...: not part of a rule
        elif line_start and kind == "name" and (end := _definition_end(tokens, i, lark)):
            current = _Rule(tok.lstrip("?!"))
            rules.append(current)
            line_start, i = False, end
            continue
        elif current is not None:
            current.body.append((kind, tok))
        line_start, i = False, i + 1
    return rules


def _definition_end(tokens: list[tuple[str, str]], i: int, lark: bool) -> int:
    """Where a rule's body starts if a definition begins at token i (`name:` / `name.2:` in
    Lark, `name ::=` in GBNF), else 0."""
    j = i + 1
    if lark and j + 1 < len(tokens) and tokens[j][1] == "." and tokens[j + 1][0] == "num":
        j += 2  # a priority
    if j < len(tokens) and tokens[j][1] == (":" if lark else "::="):
        return j + 1
    return 0


def check_grammar_text(text: str, param: str, cfg: StructuredOutputsConfig) -> None:
    """Rules, alternatives, rule chain and nesting; and a start rule that can end (a grammar
    whose every path refers back to itself has an empty language: the engine could only
    grow it until llguidance's item limit)."""
    lark = is_lark(text)
    rules = _rules(text, lark)
    if len(rules) > cfg.max_grammar_rules:
        raise over(param, "rules", len(rules), cfg.max_grammar_rules, "max-grammar-rules")
    alternatives = sum(1 + sum(tok == "|" for kind, tok in r.body if kind == "op") for r in rules)
    if alternatives > cfg.max_grammar_items:
        raise over(param, "alternatives", alternatives, cfg.max_grammar_items, "max-grammar-items")
    if not rules:
        return  # llguidance says what is wrong
    by_name = {r.name: r for r in rules}
    formulas = {r.name: _Body(r.body, lark, cfg.max_grammar_depth, param).parse() for r in rules}
    for r in rules:
        r.refs = sorted({n for n in _names(formulas[r.name]) if n in by_name})
    start = by_name.get("start" if lark else "root", rules[0])
    chain = longest_chain(start, lambda r: [by_name[n] for n in r.refs], cfg.max_grammar_depth)
    if chain > cfg.max_grammar_depth:
        raise Refused(f"{param} has a chain of more than {cfg.max_grammar_depth} rules each "
                      f"referring to the next, more than the limit (--max-grammar-depth)")
    if start.name not in _productive(rules, formulas):
        raise Refused(f"{param} can never finish: every way through rule `{start.name}` refers "
                      "back to a rule that cannot end, so no string is in its language")


# A rule body's shape, for productivity: True (always finishes), a rule's name, or
# ("and"/"or", [parts]).
_Formula = Any


class _Body:
    """A recursive-descent reader of one rule body, bounded in nesting by max_grammar_depth."""

    def __init__(self, tokens: list[tuple[str, str]], lark: bool, max_depth: int, param: str):
        self.t, self.i, self.lark = tokens, 0, lark
        self.max_depth, self.param = max_depth, param

    def parse(self) -> _Formula:
        return self._alternatives(0)

    def _peek(self) -> str | None:
        return self.t[self.i][1] if self.i < len(self.t) else None

    def _alternatives(self, depth: int) -> _Formula:
        if depth > self.max_depth:
            raise Refused(f"{self.param} nests groups more than {self.max_depth} deep "
                          f"(--max-grammar-depth)")
        alts = [self._sequence(depth)]
        while self._peek() == "|":
            self.i += 1
            alts.append(self._sequence(depth))
        return alts[0] if len(alts) == 1 else ("or", alts)

    def _sequence(self, depth: int) -> _Formula:
        parts = []
        while self.i < len(self.t) and self._peek() not in ("|", ")", "]"):
            item = self._item(depth)
            if item is not None:
                parts.append(item)
        return True if not parts else parts[0] if len(parts) == 1 else ("and", parts)

    def _item(self, depth: int) -> _Formula | None:
        kind, tok = self.t[self.i]
        self.i += 1
        if tok == "(":
            atom = self._closed(depth, ")")
        elif tok == "[" and self.lark:  # Lark's [optional]
            self._closed(depth, "]")
            atom = True
        elif kind == "name" and not tok.startswith("@"):
            atom = tok.lstrip("?!")
        elif tok == "->" and self.lark:  # an alias: its name is not a reference
            if self.i < len(self.t) and self.t[self.i][0] == "name":
                self.i += 1
            return None
        elif tok == "%json":
            self._skip_braces()
            atom = True
        elif kind in ("op", "num", "other") and tok not in ("{",):
            return None  # punctuation with no meaning for productivity
        elif tok == "{":  # a template's or GBNF's {m,n}: skipped
            self.i -= 1
            self._skip_braces()
            return None
        else:
            atom = True  # a string, regex, character class, special token, @subgrammar
        return self._repetition(atom)

    def _closed(self, depth: int, close: str) -> _Formula:
        inner = self._alternatives(depth + 1)
        if self._peek() == close:
            self.i += 1
        return inner

    def _repetition(self, atom: _Formula) -> _Formula:
        """`?`, `*`, `~ 0..n` or GBNF's `{0,n}` make an item optional: it always finishes."""
        while self.i < len(self.t):
            tok = self.t[self.i][1]
            if tok in ("?", "*"):
                atom, self.i = True, self.i + 1
            elif tok == "+":
                self.i += 1
            elif tok == "~" and self.lark:
                self.i += 1
                if self.i < len(self.t) and self.t[self.i][1] == "0":
                    atom = True
                while self.i < len(self.t) and (self.t[self.i][0] == "num" or self._peek() == ".."):
                    self.i += 1
            elif tok == "{" and not self.lark:
                if self.i + 1 < len(self.t) and self.t[self.i + 1][1] in ("0", ","):
                    atom = True
                self._skip_braces()
            else:
                break
        return atom

    def _skip_braces(self) -> None:
        """Past a balanced {...} (an inline %json schema, a template's arguments, {m,n})."""
        level = 0
        while self.i < len(self.t):
            tok = self.t[self.i][1]
            self.i += 1
            if tok == "{":
                level += 1
            elif tok == "}":
                level -= 1
                if level <= 0:
                    return


def _names(f: _Formula) -> Iterator[str]:
    stack = [f]
    while stack:
        x = stack.pop()
        if isinstance(x, str):
            yield x
        elif isinstance(x, tuple):
            stack.extend(x[1])


def _finishes(f: _Formula, productive: set[str], known: set[str]) -> bool:
    """Whether formula f derives a finite string, given the rules known to (an unknown name:
    %import'ed or undefined, which llguidance reports itself, counts as finishing). Recurses
    only along groups, which _Body bounds to max_grammar_depth."""
    if f is True:
        return True
    if isinstance(f, str):
        return f in productive or f not in known
    op, parts = f
    for p in parts:
        if _finishes(p, productive, known) == (op == "or"):
            return op == "or"
    return op == "and"


def _productive(rules: list[_Rule], formulas: dict[str, _Formula]) -> set[str]:
    """The rules that derive some finite string: a worklist fixpoint (each rule is looked at
    again only when a rule it refers to becomes productive)."""
    known = set(formulas)
    users: dict[str, list[str]] = {}
    for r in rules:
        for n in r.refs:
            users.setdefault(n, []).append(r.name)
    productive: set[str] = set()
    todo = [r.name for r in rules]
    while todo:
        name = todo.pop()
        if name in productive or not _finishes(formulas[name], productive, known):
            continue
        productive.add(name)
        todo.extend(u for u in users.get(name, ()) if u not in productive)
    return productive
