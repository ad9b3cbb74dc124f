"""Hypothesis strategies for hostile but plausible chat bodies: what a client
can make the server compute through a request's own program (its chat
template) or its grammar (structured outputs, a forced tool call).

- templates put together from random pieces: repetition (`'a' * N`,
  `N * [..]`) with small and huge N, `+` and `~`, doubling in a loop,
  nested `range()` loops, filters that pad (`center`, `indent`, `wordwrap`,
  `format`) to huge widths, `**` with huge exponents, recursive macros,
  `raise_exception`, attribute escapes (`__class__`, `__subclasses__`),
  `{% generation %}`, the template's variables, and malformed Jinja;
- constraints: regexes of nested counted repetitions and wide alternations,
  chained Lark grammars of random depth (deep chains overflow llguidance's
  native stack), wide Lark alternations, GBNF, JSON schemas with `$ref`
  cycles, deep nesting and huge enums, `choice` lists of any size;
- chat bodies that carry those in `chat_template`, `chat_template_kwargs`,
  `structured_outputs`, `response_format` and `tools` with a forced choice.

Large values are built from a drawn size (`.map`), not drawn item by item,
so a 10,000-way alternation costs hypothesis one integer.

Deep nesting reaches past Python's recursion limit (1,000): send bodies with
`json_text`, which encodes them under a raised limit.
"""
from __future__ import annotations

import json
import sys
from typing import Any

from hypothesis import strategies as st


def weighted(*options: tuple[int, st.SearchStrategy]) -> st.SearchStrategy:
    """One of the strategies, each as likely as its weight."""
    strategies = [strategy for _, strategy in options]
    return st.sampled_from([i for i, (weight, _) in enumerate(options) for _ in range(weight)]).flatmap(
        strategies.__getitem__)


# ---- numbers ------------------------------------------------------------------------------

HUGE = st.sampled_from([99, 1000, 4097, 99999, 100001, 10**6, 10**9, 10**12])
COUNT = weighted((2, HUGE), (1, st.integers(0, 40)))
"""A repetition count, width or exponent: huge, or small. (The hostile values come first
throughout: the fuzz runs few examples, and hypothesis starts with the simplest.)"""
LOOP = weighted((2, st.sampled_from([99999, 100000, 100001, 999, 10**6, 10**12])), (1, st.integers(0, 30)))
"""A range() bound: jinja's sandbox refuses ranges over 100,000."""

# ---- chat templates -----------------------------------------------------------------------

ATOMS = st.sampled_from([
    "'a'", "'ab'", "''", "'\\n'", "'{{ x }}'", "[1, 2]", "['x']", "[]", "{'k': 'v'}", "none", "true", "1.5",
    "messages", "messages[0]", "messages[0].content", "messages[-1]['role']", "messages | length",
    "messages | tojson", "tools", "tools | tojson", "tools[0].function.name", "bos_token", "eos_token",
    "add_generation_prompt", "documents", "enable_thinking", "undefined_name", "loop", "ns",
    "strftime_now('%Y-%m-%d')", "namespace(s='a')", "dict(a=1)", "range(5) | list", "lipsum(2)",
    "cycler('a', 'b').next()", "joiner(',')()", "messages | map(attribute='content') | join",
])
ESCAPES = st.sampled_from([
    "''.__class__", "''.__class__.__mro__[1].__subclasses__()", "().__class__.__bases__[0].__subclasses__()",
    "messages.__class__.__subclasses__()", "cycler.__init__.__globals__", "namespace.__init__.__globals__['os']",
    "lipsum.__globals__['os'].system('true')", "raise_exception.__globals__", "self.__init__.__globals__",
    "self._TemplateReference__context", "range.__self__.__import__('os')", "messages.append(1)", "messages.pop()",
    "(messages | first).update({'role': 'x'})", "''.format.__globals__", "dict.__base__.__subclasses__()",
    "[].__class__.__mro__[-1].__subclasses__()", "strftime_now.__globals__['datetime']",
    "'{0.__class__.__mro__}'.format('')", "'%s' | format(''.__class__)",
])


def _expressions(children: st.SearchStrategy[str]) -> st.SearchStrategy[str]:
    n = COUNT.map(str)
    return st.one_of(
        st.tuples(children, n).map(lambda p: f"({p[0]} * {p[1]})"),
        st.tuples(n, children).map(lambda p: f"({p[0]} * {p[1]})"),
        st.tuples(n, st.sampled_from(["'a'", "'xyz'", "[0]", "['a', 'b']", "[[1] * 1000]"])).map(
            lambda p: f"({p[0]} * {p[1]})"),
        st.tuples(children, children).map(lambda p: f"({p[0]} + {p[1]})"),
        st.tuples(children, children).map(lambda p: f"({p[0]} ~ {p[1]})"),
        st.tuples(n, n).map(lambda p: f"({p[0]} ** {p[1]})"),
        st.tuples(COUNT, COUNT).map(lambda p: f"({p[0] + 2} ** {p[1]} ** {p[1]})"),
        st.tuples(children, n).map(lambda p: f"({p[0]} | string | center({p[1]}))"),
        st.tuples(children, n).map(lambda p: f"({p[0]} | string | indent({p[1]}, true))"),
        st.tuples(children, n).map(lambda p: f"({p[0]} | string | wordwrap({p[1]}))"),
        st.tuples(n, children).map(lambda p: f"('%{p[0]}s' | format({p[1]}))"),
        st.tuples(n, children).map(lambda p: f"('%.{p[0]}f' | format(1.5))"),
        st.tuples(children, n).map(lambda p: f"({p[0]} | string | truncate({p[1]}))"),
        st.tuples(children, children).map(lambda p: f"({p[0]} | join({p[1]}))"),
        st.tuples(children, children).map(lambda p: f"({p[0]} | string | replace('', {p[1]}))"),
        st.tuples(children, n).map(lambda p: f"({p[0]} | batch({p[1]}) | list)"),
        st.tuples(n, children).map(lambda p: f"(range({p[0]}) | map('string') | join({p[1]}))"),
        st.tuples(children, children).map(lambda p: f"({p[0]}[{p[1]}])"),
        children.map(lambda e: f"({e} | tojson(indent=4))"),
        children.map(lambda e: f"({e} | length)"),
        children.map(lambda e: f"({e} | reverse | list)"),
        children.map(lambda e: f"raise_exception({e})"),
        children.map(lambda e: f"({e} if {e} else {e})"),
    )


EXPRESSIONS = st.recursive(st.one_of(ATOMS, COUNT.map(str), ESCAPES), _expressions, max_leaves=4)

MALFORMED = st.sampled_from([
    "{% for x in %}", "{{", "{{ 'a' ** }}", "{% endfor %}", "{% generation %}", "{% endgeneration %}", "{% if %}",
    "{% set %}", "{#", "{% raw %}", "{% include 'x' %}", "{% extends 'base' %}", "{% import 'x' as y %}",
    "}}}}", "{% call %}", "{% break %}", "{% macro %}", "{{ messages[ }}", "{% for i in range(3) %}",
    "{%- -%}", "{{ 'unterminated }}", "{% filter upper %}", "{% with %}", "{% autoescape %}", "{% do 1 %}",
    "\x00", "{{ 1 / 0 }}", "{{ 'a' | no_such_filter }}", "{{ 1 is no_such_test }}", "{{ (1, 2) * }}",
])
TEXT = st.sampled_from([
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}",
    "", "x", "\n", "<s>[INST] ", " [/INST]", "<|im_start|>", "{{- bos_token }}",
    "{% raw %}{{ 'a' * 10**9 }}{% endraw %}",
])


def _statements(body: st.SearchStrategy[str]) -> st.SearchStrategy[str]:
    e, k, n = EXPRESSIONS, LOOP.map(str), COUNT.map(str)
    return st.one_of(  # the first option is what hypothesis tries first: a hostile one
        e.map(lambda x: "{{ %s }}" % x),
        st.tuples(e, body).map(lambda p: "{%% set x = %s %%}%s{{ x }}" % p),
        st.tuples(e, k, body).map(lambda p: (
            "{%% set ns = namespace(s=%s) %%}{%% for i in range(%s) %%}{%% set ns.s = ns.s ~ ns.s %%}%s"
            "{%% endfor %%}{{ ns.s | length }}" % p)),
        st.tuples(k, body).map(lambda p: (
            "{%% set ns = namespace(s=[1]) %%}{%% for i in range(%s) %%}{%% set ns.s = ns.s + ns.s %%}{%% endfor %%}"
            "%s{{ ns.s | length }}" % p)),
        st.tuples(k, body).map(lambda p: "{%% for i in range(%s) %%}%s{%% endfor %%}" % p),
        st.tuples(k, k, body).map(lambda p: (
            "{%% for i in range(%s) %%}{%% for j in range(%s) %%}%s{%% endfor %%}{%% endfor %%}" % p)),
        st.tuples(k, k, k).map(lambda p: (
            "{%% for i in range(%s) %%}{%% for j in range(%s) %%}{%% for k in range(%s) %%}{%% endfor %%}"
            "{%% endfor %%}{%% endfor %%}x" % p)),
        body.map(lambda b: "{%% for m in messages %%}{{ m.role }}{{ m['content'] }}%s{%% endfor %%}" % b),
        body.map(lambda b: "{%% for t in tools or [] %%}{{ t | tojson }}%s{%% endfor %%}" % b),
        st.tuples(e, body, body).map(lambda p: "{%% if %s %%}%s{%% else %%}%s{%% endif %%}" % p),
        body.map(lambda b: "{%% generation %%}%s{%% endgeneration %%}" % b),
        body.map(lambda b: "{%% if add_generation_prompt %%}%s{%% endif %%}" % b),
        st.just("{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(0) }}"),
        st.just("{% macro f(n) %}{{ f(n + 1) ~ f(n + 1) }}{% endmacro %}{{ f(0) }}"),
        k.map(lambda x: "{%% macro f(n) %%}{%% if n > 0 %%}{{ f(n - 1) }}{{ f(n - 1) }}{%% endif %%}x"
                        "{%% endmacro %%}{{ f(%s) }}" % x),
        n.map(lambda x: "{%% macro f(n) %%}{{ caller() * %s }}{%% endmacro %%}{%% call f(1) %%}ab{%% endcall %%}" % x),
        e.map(lambda x: "{{ raise_exception(%s) }}" % x),
        ESCAPES.map(lambda x: "{{ %s }}" % x),
        st.tuples(body, MALFORMED).map("".join),
        st.lists(body, min_size=2, max_size=3).map("".join),
    )


TEMPLATES = weighted(
    (2, _statements(st.one_of(TEXT, MALFORMED))),
    (2, st.recursive(st.one_of(TEXT, MALFORMED), _statements, max_leaves=6)),
    (1, st.lists(_statements(TEXT), min_size=2, max_size=4).map("".join)),
)
"""A chat template: one hostile statement, a random composition of them (malformed ones
too), or several in a row."""

# ---- structured outputs -----------------------------------------------------------------

SIZE = weighted((2, st.sampled_from([4000, 3000, 2000, 1000, 500, 100, 4096, 4097, 10_000])), (1, st.integers(1, 50)))
"""How many rules, alternatives, enum values or choices."""
DEPTH = weighted((2, st.integers(940, 1000)), (2, st.sampled_from([100, 300, 500, 900, 1500, 3000])),
                 (1, st.integers(1, 60)))
"""How deeply a JSON schema or a template variable nests (a schema's body nests two or three
times as deep). 940-1000: a body that Python's JSON parser reads (it stops near 1,000) but
that other recursive code of the API server, with more frames under it, may not."""


def _chained_lark(rules: int, form: str) -> str:
    """`r0: "t0" r1?`, `r1: "t1" r2?`, ...: llguidance recurses once per rule."""
    lines = ["start: r0"]
    for i in range(rules - 1):
        lines.append(f"r{i}: " + form.format(i=i, j=i + 1))
    lines.append(f'r{rules - 1}: "t{rules - 1}"')
    return "\n".join(lines)


def _chained_gbnf(rules: int) -> str:
    lines = ["root ::= r0"] + [f'r{i} ::= "t{i}" r{i + 1}?' for i in range(rules - 1)] + [f'r{rules - 1} ::= "t"']
    return "\n".join(lines)


LARK_CHAIN_FORMS = st.sampled_from(['"t{i}" r{j}?', '"t{i}" r{j}', 'r{j} "t{i}"', '("t{i}" | r{j})+',
                                    '"t{i}" r{j}*', '"(" r{j} ")" | "t{i}"'])
REGEXES = st.one_of(
    st.tuples(COUNT, COUNT).map(lambda p: f"(a{{{p[0]}}}){{{p[1]}}}"),
    st.tuples(COUNT, COUNT, COUNT).map(lambda p: f"((a{{{p[0]}}}){{{p[1]}}}){{{p[2]}}}"),
    st.tuples(COUNT, COUNT).map(lambda p: f"[a-z]{{{p[0]},{p[0] + p[1]}}}"),
    SIZE.map(lambda n: "(" + "|".join(f"w{i}" for i in range(n)) + ")"),
    SIZE.map(lambda n: "(" * n + "a" + ")*" * n),
    SIZE.map(lambda n: "(a|" * n + "b" + ")" * n),
    st.sampled_from(["(a*)*b", "(a|aa)+$", ".*.*.*.*=.*", "\\p{L}{1000}", "(?i)[\\w\\W]{99999}", "(", "[", "a{2,1}",
                     "a{99999999999}", "\\", "(?<n>a)\\k<n>", "(?=a)a", "^$", ""]),
)
GRAMMARS = st.one_of(
    st.tuples(SIZE, LARK_CHAIN_FORMS).map(lambda p: _chained_lark(*p)),
    SIZE.map(lambda n: "start: " + " | ".join(f'"a{i}"' for i in range(n))),
    SIZE.map(lambda n: "start: " + "(" * n + '"a"' + ")" * n),
    st.tuples(COUNT, COUNT).map(lambda p: f'start: ("a"{{{p[0]}}}){{{p[1]}}}'),
    st.tuples(COUNT).map(lambda p: f'start: /a{{{p[0]}}}/'),
    SIZE.map(_chained_gbnf),
    st.tuples(COUNT, COUNT).map(lambda p: f'root ::= ("a"{{{p[0]}}}){{{p[1]}}}'),
    SIZE.map(lambda n: "root ::= " + " | ".join(f'"g{i}"' for i in range(n))),
    st.sampled_from([
        "start: start start | \"a\"", "start: start", "start: a\na: b\nb: a", "root ::= root", "root ::= [",
        "start: %json {\"$ref\": \"#\"}", "start: /(a*)*b/", "", "start:", "root ::= ", "%import common.NUMBER",
        "start: x\nx: \"a\" x? | \"b\"\n" * 3, "root ::= [^\\x00-\\U0010FFFF]", "start: \"\\uD800\"",
    ]),
)


def _nested(depth: int, kind: str) -> dict:
    schema: dict = {"type": "string"}
    for i in range(depth):
        if kind == "properties":
            schema = {"type": "object", "properties": {f"p{i}": schema}, "required": [f"p{i}"]}
        elif kind == "items":
            schema = {"type": "array", "items": schema, "minItems": 1}
        else:
            schema = {"anyOf": [schema, {"type": "null"}]}
    return schema


SCHEMAS = st.one_of(
    st.just({"$ref": "#"}),
    st.just({"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}),
    st.just({"type": "object", "properties": {"next": {"$ref": "#"}}, "required": ["next"]}),
    st.just({"type": "array", "items": {"$ref": "#"}, "minItems": 1}),
    st.just({"$ref": "#/$defs/missing"}),
    st.just({"$ref": "http://example.com/schema.json"}),
    st.tuples(DEPTH, st.sampled_from(["properties", "items", "anyOf"])).map(lambda p: _nested(*p)),
    SIZE.map(lambda n: {"enum": [f"v{i}" for i in range(n)]}),
    SIZE.map(lambda n: {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(n)},
                        "required": [f"p{i}" for i in range(n)]}),
    SIZE.map(lambda n: {"anyOf": [{"const": f"c{i}"} for i in range(n)]}),
    COUNT.map(lambda n: {"type": "string", "minLength": n, "maxLength": n}),
    COUNT.map(lambda n: {"type": "array", "items": {"type": "integer"}, "minItems": n}),
    COUNT.map(lambda n: {"type": "string", "pattern": f"(a{{{n}}}){{{n}}}"}),
    COUNT.map(lambda n: {"type": "integer", "minimum": n, "maximum": -n, "multipleOf": n or 1}),
    st.sampled_from([{}, {"type": "nothing"}, {"not": {}}, {"allOf": [{"type": "string"}, {"type": "integer"}]},
                     {"type": "string", "format": "no-such-format"}, {"if": {}, "then": {}, "else": {}},
                     {"type": "number", "multipleOf": 1e-300}, {"oneOf": [{}, {}]}]),
)
STRUCTURED_OUTPUTS = st.one_of(
    REGEXES.map(lambda r: {"regex": r}),
    GRAMMARS.map(lambda g: {"grammar": g}),
    SCHEMAS.map(lambda s: {"json": s}),
    SCHEMAS.map(lambda s: {"json": json_text(s)}),
    SIZE.map(lambda n: {"choice": [f"choice {i}" for i in range(n)]}),
    st.sampled_from([{"choice": []}, {"choice": [""]}, {"json_object": True}, {}, {"regex": "a", "choice": ["a"]}]),
)

# ---- chat bodies ----------------------------------------------------------------------------


def _deep_list(depth: int) -> Any:
    value: Any = 1
    for _ in range(depth):
        value = [value]
    return value


KWARG_VALUES = st.one_of(
    st.booleans(), st.none(), COUNT, st.sampled_from(["", "x", "{{ 'a' * 10**9 }}"]),
    st.sampled_from([1000, 60_000, 70_000]).map(lambda n: "k" * n),
    DEPTH.map(_deep_list),
    SIZE.map(lambda n: list(range(n))),
)
TEMPLATE_KWARGS = st.dictionaries(
    st.sampled_from(["enable_thinking", "bos_token", "eos_token", "messages", "tools", "add_generation_prompt",
                     "documents", "x", "ns", "raise_exception", "range", "namespace", "__class__"]),
    KWARG_VALUES, max_size=3,
)
MESSAGES = weighted(
    (9, st.lists(st.fixed_dictionaries({
        "role": weighted((6, st.just("user")), (1, st.sampled_from(["system", "assistant", "tool", "developer", "x"]))),
        "content": weighted((6, st.just("hi")),
                            (2, st.sampled_from(["", "{{ 'a' * 10**9 }}", "{% for i in range(99999) %}"])),
                            (1, st.sampled_from([1000, 10**5]).map(lambda n: "ab " * n))),
    }), min_size=1, max_size=3)),
    (1, st.just([])),
)
"""Mostly a short user message, so that the hostile part is what the body is judged by."""


def _tools(count: int, parameters: dict, named: bool) -> dict:
    tools = [{"type": "function", "function": {"name": f"f{i}", "parameters": parameters}} for i in range(count)]
    choice: Any = {"type": "function", "function": {"name": "f0"}} if named else "required"
    return {"tools": tools, "tool_choice": choice}


HOSTILE_PARTS = {
    "chat_template": TEMPLATES.map(lambda t: {"chat_template": t}),
    "chat_template_kwargs": TEMPLATE_KWARGS.map(lambda k: {"chat_template_kwargs": k}),
    "structured_outputs": STRUCTURED_OUTPUTS.map(lambda s: {"structured_outputs": s}),
    "response_format": st.one_of(
        SCHEMAS.map(lambda s: {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": s}}}),
        st.sampled_from([{"response_format": {"type": "json_object"}},
                         {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}]),
    ),
    "tools": weighted(
        (3, st.tuples(st.integers(1, 4), st.one_of(SCHEMAS, st.just({"type": "object"})), st.booleans())),
        (1, st.tuples(st.sampled_from([128, 129, 1000]), st.just({"type": "object"}), st.booleans())),
    ).map(lambda p: _tools(*p)),
}
WEIGHTS = {"chat_template": 5, "chat_template_kwargs": 1, "structured_outputs": 4, "response_format": 1, "tools": 2}
"""Templates and grammars are what the sandbox is for: most bodies carry one."""


class Body(dict):
    """A request body that hypothesis reports as (the start of) its JSON: its
    own printer recurses once per level, and a hostile body nests deeper than
    Python's recursion limit or runs to megabytes."""

    def __repr__(self) -> str:
        text = json_text(self)
        return text if len(text) <= 2000 else f"{text[:2000]}... ({len(text)} characters)"

    def _repr_pretty_(self, printer, cycle) -> None:
        printer.text(repr(self))


def chat_bodies() -> st.SearchStrategy[Body]:
    """Chat completion bodies with one hostile part (and now and then a second)."""
    parts = st.sampled_from([name for name, weight in WEIGHTS.items() for _ in range(weight)])
    hostile = st.tuples(parts, parts, st.integers(0, 3)).flatmap(
        lambda p: st.tuples(HOSTILE_PARTS[p[0]], HOSTILE_PARTS[p[1]] if p[2] == 0 else st.just({})))
    flags = weighted((3, st.just({})), (1, st.fixed_dictionaries({}, optional={
        "stream": st.booleans(), "add_generation_prompt": st.booleans(), "continue_final_message": st.booleans(),
        "temperature": st.just(0)})))
    base = st.tuples(st.fixed_dictionaries({"messages": MESSAGES, "max_tokens": st.integers(1, 3)}), flags).map(
        lambda p: {**p[0], **p[1]})
    return st.tuples(base, hostile).map(lambda p: Body({**p[0], **p[1][0], **p[1][1]}))


def tokenize_body(chat_body: dict) -> dict:
    """The /tokenize body of a chat body: its messages, and the template fields it has (which /tokenize may
    ignore: it must still answer below 500)."""
    names = ("messages", "chat_template", "chat_template_kwargs", "tools", "add_generation_prompt",
             "continue_final_message")
    return {name: chat_body[name] for name in names if name in chat_body}


def json_text(value: Any) -> str:
    """`value` as JSON, nested as deeply as it is (past Python's default recursion limit)."""
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 20_000))
    try:
        return json.dumps(value)
    finally:
        sys.setrecursionlimit(limit)
