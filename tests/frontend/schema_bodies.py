"""Hypothesis strategies for request bodies, read from the server's own
OpenAPI schema. Three kinds:

- tame: the right shape with small values, so that most get past validation
  into sampling, tokenising and the engine, in random combinations;
- one wild spot: a tame body with one value, at any depth, replaced by a wild
  one (huge or negative integers, NaN, lone surrogates, empty strings, a
  value of the wrong type). Only one, so the body fails (or passes) there,
  not at the first of many bad fields;
- any JSON at all.
"""
from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

EDGE_INTEGERS = st.sampled_from([0, -1, 1, 2, 16, 127, 128, 129, 2**31, 2**63 - 1, 2**63, -(2**63) - 1, 2**64, 2**70])
INTEGERS = st.one_of(st.integers(-3, 140), EDGE_INTEGERS, st.integers())
FLOATS = st.one_of(
    st.floats(-3, 3), st.sampled_from([0.0, 1.0, 1e-9, -100.0, 100.0, 100.5, 1e308]), st.floats(allow_nan=True)
)
ANY_CHARACTER = st.characters(codec=None, exclude_categories=())
"""Surrogates included: json.dumps escapes them, as a client in another language might send them."""
STRINGS = st.one_of(st.text(max_size=12), st.text(ANY_CHARACTER, max_size=6), st.sampled_from(["", "\ud800", "Hi"]))
ANY_JSON = st.recursive(
    st.none() | st.booleans() | INTEGERS | FLOATS | STRINGS,
    lambda children: st.lists(children, max_size=3) | st.dictionaries(STRINGS, children, max_size=3),
    max_leaves=6,
)

TAME_LEAVES = {
    "integer": st.integers(1, 8),
    "number": st.floats(0.1, 1.5) | st.just(1),
    "string": st.text("abc xyz.!", min_size=1, max_size=8),
    "boolean": st.booleans(),
    "null": st.none(),
}
WILD_LEAVES = {
    "integer": INTEGERS,
    "number": FLOATS | INTEGERS,
    "string": STRINGS,
    "boolean": st.booleans(),
    "null": st.none(),
}
TAME_LEFT_OUT = {"model", "suffix"}
"""Fields a tame body leaves out: any model name but the served one is a 404, any suffix a 400."""
TAME_FREE_FORM = st.one_of(
    st.dictionaries(st.integers(0, 60).map(str), st.floats(-5, 5), max_size=3),  # logit_bias
    st.fixed_dictionaries({"type": st.just("text"), "text": TAME_LEAVES["string"]}),  # a content part
)


def body_strategy(openapi: dict, path: str) -> st.SearchStrategy[Any]:
    """Bodies for POST `path`: tame, with one wild spot, or anything."""
    schema = openapi["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
    bodies = _Bodies(openapi)
    return st.one_of(bodies.tame(schema), bodies.wild(schema), bodies.wild(schema), ANY_JSON)


class _Bodies:
    def __init__(self, openapi: dict):
        self.definitions = openapi.get("components", {}).get("schemas", {})

    def _resolve(self, schema: dict) -> dict:
        while "$ref" in schema:
            schema = self.definitions[schema["$ref"].rsplit("/", 1)[-1]]
        return schema

    def tame(self, schema: dict) -> st.SearchStrategy[Any]:
        schema = self._resolve(schema)
        for key in ("anyOf", "oneOf"):
            if key in schema:
                return st.one_of(*(self.tame(option) for option in schema[key]))
        if "enum" in schema or "const" in schema:
            return st.sampled_from(schema.get("enum", [schema.get("const")]))
        kind = schema.get("type")
        if kind == "array":
            return st.lists(self.tame(schema.get("items", {})), min_size=1, max_size=3)
        if kind == "object" or "properties" in schema:
            properties = self._tame_properties(schema)
            if not properties:
                return TAME_FREE_FORM
            required = set(schema.get("required", []))
            return st.fixed_dictionaries(
                {name: self.tame(sub) for name, sub in properties.items() if name in required},
                optional={name: self.tame(sub) for name, sub in properties.items() if name not in required},
            )
        return TAME_LEAVES.get(kind, TAME_LEAVES["string"])

    def _tame_properties(self, schema: dict) -> dict[str, dict]:
        return {name: sub for name, sub in schema.get("properties", {}).items() if name not in TAME_LEFT_OUT}

    def wild(self, schema: dict) -> st.SearchStrategy[Any]:
        """A value of `schema` that is tame but for one spot, somewhere inside it."""
        schema = self._resolve(schema)
        for key in ("anyOf", "oneOf"):
            if key in schema:
                options = schema[key]
                return self._weighted(dict(enumerate(options))).map(options.__getitem__).flatmap(self.wild)
        kind = schema.get("type")
        if kind == "array":
            return self._wild_list(schema.get("items", {}))
        if kind == "object" or "properties" in schema:
            return self._wild_object(schema)
        return st.one_of(WILD_LEAVES.get(kind, ANY_JSON), ANY_JSON)

    def _wild_list(self, items: dict) -> st.SearchStrategy[list]:
        tame_items = st.lists(self.tame(items), max_size=2)
        return st.one_of(
            st.tuples(tame_items, self.wild(items), tame_items).map(lambda parts: [*parts[0], parts[1], *parts[2]]),
            st.just([]),
            ANY_JSON,
        )

    def _wild_object(self, schema: dict) -> st.SearchStrategy[dict]:
        properties = schema.get("properties", {})
        if not properties:  # free-form: logit_bias (token id -> bias), a content part
            content_part = st.fixed_dictionaries(
                {}, optional={"type": st.sampled_from(["text", "image_url"]) | ANY_JSON, "text": STRINGS | ANY_JSON}
            )
            keys = st.one_of(INTEGERS.map(str), STRINGS)
            return st.one_of(st.dictionaries(keys, FLOATS | ANY_JSON, max_size=3), content_part, ANY_JSON)
        return st.tuples(self.tame(schema), self._weighted(properties)).flatmap(
            lambda drawn: self.wild(properties[drawn[1]]).map(lambda value: {**drawn[0], drawn[1]: value})
        )

    def _weighted(self, schemas: dict[Any, dict]) -> st.SearchStrategy[Any]:
        """A key of `schemas`, each as likely as its schema has places for a
        wild value: a field holding a list of messages is chosen more often
        than a boolean, so that the fuzz reaches as deep as the schema goes."""
        return st.sampled_from([key for key, sub in schemas.items() for _ in range(self._size(sub))])

    def _size(self, schema: dict) -> int:
        schema = self._resolve(schema)
        for key in ("anyOf", "oneOf"):
            if key in schema:
                return sum(self._size(option) for option in schema[key])
        if schema.get("type") == "array":
            return 1 + self._size(schema.get("items", {}))
        properties = schema.get("properties", {})
        if properties:
            return 1 + sum(self._size(sub) for sub in properties.values())
        return 3 if schema.get("type") == "object" else 1
