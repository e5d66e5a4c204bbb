"""JsonSpeller (aiolm/server/tool_parsers/json_stream.py): fed any JSON in any pieces, it
spells exactly what json.dumps writes for the parsed value, and never takes a character back."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from aiolm.server.tool_parsers.json_stream import JsonCallsReader, JsonSpeller

_SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(-(10**20), 10**20)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8)
)
_VALUES = st.recursive(
    _SCALARS,
    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=5), kids, max_size=4),
    max_leaves=12,
)
_LAYOUTS = [
    {},
    {"indent": 2},
    {"separators": (",", ":")},
    {"ensure_ascii": False},
]


@settings(max_examples=300, deadline=None)
@given(
    value=st.dictionaries(st.text(max_size=5), _VALUES, max_size=4),
    layout=st.sampled_from(_LAYOUTS),
    cuts=st.lists(st.integers(1, 6), max_size=200),
)
def test_spelt_like_json_dumps_and_never_taken_back(value, layout, cuts):
    raw = json.dumps(value, **layout)
    sp = JsonSpeller()
    before, pos = "", 0
    for n in [*cuts, len(raw)]:
        sp.feed(raw[pos : pos + n])
        pos += n
        now = sp.text()
        assert now.startswith(before)
        before = now
        if pos >= len(raw):
            break
    assert sp.done and not sp.failed
    assert sp.text() == json.dumps(json.loads(raw), ensure_ascii=False)


def test_strings_are_released_as_they_arrive():
    sp = JsonSpeller()
    sp.feed('{"code": "def f():\\n    ret')
    assert sp.text() == '{"code": "def f():\\n    ret'
    sp.feed('urn 1"}')
    assert sp.done and sp.text() == '{"code": "def f():\\n    return 1"}'


def test_escapes_split_anywhere_and_surrogate_pairs():
    raw = '{"s": "\\u00e9\\ud83d\\ude00\\"\\/"}'
    for step in range(1, 8):
        sp = JsonSpeller()
        for i in range(0, len(raw), step):
            sp.feed(raw[i : i + step])
        assert sp.text() == json.dumps(json.loads(raw), ensure_ascii=False) == '{"s": "é😀\\"/"}'


def test_not_json_fails_and_stops():
    for bad in ['{"a" 1}', '{"a": tru}', '{"a": "x\ny"}', '{"a": 1,,}', "{'a': 1}", '{"a": [1 2]}']:
        sp = JsonSpeller()
        sp.feed(bad)
        assert sp.failed or not sp.done, bad


def test_reader_takes_call_objects_one_after_another():
    r = JsonCallsReader(("parameters", "arguments"))
    r.feed('[{"name": "a", "parameters": {"x": 1}}, {"name": "b"}, {"arguments": "{\\"y\\": 2}", "name": "c"}]')
    assert [(c.name, c.arguments, c.done) for c in r.calls] == [
        ("a", '{"x": 1}', True),
        ("b", "{}", True),
        ("c", '{"y": 2}', True),
    ]
