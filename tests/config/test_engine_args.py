"""EngineArgs is written out field by field (so editors and type checkers
see it); this keeps it in step with the config classes it flattens."""
from __future__ import annotations

import dataclasses

from fleet.config.engine_args import FLAT_GROUPS, NESTED_GROUPS, EngineArgs, user_fields


def default_of(field: dataclasses.Field):
    return field.default_factory() if field.default is dataclasses.MISSING else field.default


def test_engine_args_has_every_user_field_with_its_type_and_default_in_order():
    expected = [(f.name, f.type, default_of(f)) for cls in FLAT_GROUPS.values() for f in user_fields(cls)]
    # Off unless given: --kv-transfer-config (no KV transfer by default).
    off_unless_given = {"kv_transfer_config", "speculative_config"}
    expected += [(name, f"{cls.__name__} | None", None) if name in off_unless_given else (name, cls.__name__, cls())
                 for name, cls in NESTED_GROUPS.items()]
    actual = [(f.name, f.type, default_of(f)) for f in dataclasses.fields(EngineArgs)]
    assert actual == expected


def test_engine_args_fields_fill_each_config_class():
    args = EngineArgs(tensor_parallel_size=2, block_size=32, port=9000, max_num_seqs=7)
    for name, cls in FLAT_GROUPS.items():
        built = cls(**args._group(name))
        assert all(getattr(built, f.name) == getattr(args, f.name) for f in user_fields(cls)), name
