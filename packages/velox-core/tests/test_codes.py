"""The code records the decode kernels read (``velox_core.kernels.records``): one typed
record per layout, built by keyword, its kind a class constant, checked when built."""

from __future__ import annotations

import dataclasses

import mlx.core as mx
import pytest

from velox_core.kernels import decode as dk
from velox_core.kernels import records
from velox_core.kernels import records as krec

U32 = mx.zeros((1, 1, 4, 16), mx.uint32)
F16 = mx.zeros((1, 1, 4), mx.float16)
LEV = mx.zeros((16,), mx.float32)

# each record class, its kind, the arguments of a valid record, and its kernels' view (a, b,
# levels) as the fields it maps to
CASES = [
    (
        krec.AffineCodes,
        krec.AFFINE,
        dict(bits=4, group=64, codes=U32, scale=F16, zero=F16),
        ("scale", "zero", None),
    ),
    (
        krec.ChannelAffineCodes,
        krec.AFFINE_CHANNEL,
        dict(bits=2, group=32, codes=U32, scale=F16, zero=F16),
        ("scale", "zero", None),
    ),
    (
        krec.CodebookCodes,
        krec.CODEBOOK,
        dict(bits=4, dim=128, codes=U32, norm=F16, levels=LEV),
        ("norm", None, "levels"),
    ),
]
IDS = [c[0].__name__ for c in CASES]


@pytest.mark.parametrize("cls,kind,kw,view", CASES, ids=IDS)
def test_each_record_builds_by_keyword_and_carries_its_kind(cls, kind, kw, view):
    rec = cls(**kw)
    assert isinstance(rec, krec.CodeRecord) and rec.kind == cls.kind == kind
    for name, value in kw.items():
        assert getattr(rec, name) is value
    for attr, field in zip(("a", "b", "levels"), view):
        assert getattr(rec, attr) is (None if field is None else getattr(rec, field)), attr
    assert rec.codes is U32 and not hasattr(rec, "__dict__")  # slots: no stray attributes
    with pytest.raises(TypeError):
        cls(*kw.values())  # keyword only
    assert dataclasses.replace(rec).kind == kind


def test_the_kernels_view_of_the_optional_parts():
    """What a layout lacks reads as None (``symmetric`` False) and cannot be set; a codebook's
    group is its head dim."""
    affine = krec.AffineCodes(bits=4, group=64, codes=U32, scale=F16, zero=F16)
    assert (affine.signs, affine.rnorm, affine.levels) == (None,) * 3
    assert affine.symmetric is False
    with pytest.raises(AttributeError):
        affine.symmetric = True
    cb = krec.CodebookCodes(bits=2, dim=96, codes=U32, norm=F16, levels=LEV[:4], symmetric=True)
    assert cb.group == 96 and cb.symmetric is True and cb.signs is None
    prod = dataclasses.replace(cb, signs=U32, rnorm=F16)
    assert prod.signs is U32 and prod.rnorm is F16


def test_required_fields_take_no_default():
    """Only the optional parts have defaults: a field named like one of the base's view
    attributes (``levels``) must not take that attribute as its."""
    optional = {
        (krec.CodebookCodes, "symmetric"): False,
        (krec.CodebookCodes, "signs"): None,
        (krec.CodebookCodes, "rnorm"): None,
    }
    for cls, *_ in CASES:
        for f in dataclasses.fields(cls):
            want = optional.get((cls, f.name), dataclasses.MISSING)
            assert f.default is want and f.kw_only, (cls.__name__, f.name)


@pytest.mark.parametrize("bits", [0, 9, 3.0, None, True])
def test_widths_outside_1_to_8_are_refused(bits):
    with pytest.raises(ValueError, match="bits must be an int from 1 to 8"):
        krec.AffineCodes(bits=bits, group=64, codes=U32, scale=F16, zero=F16)
    with pytest.raises(ValueError, match="CodebookCodes: bits"):
        krec.CodebookCodes(bits=bits, dim=128, codes=U32, norm=F16, levels=LEV)


def test_bad_groups_are_refused():
    with pytest.raises(ValueError, match="ChannelAffineCodes: group must be a positive int"):
        krec.ChannelAffineCodes(bits=2, group=-32, codes=U32, scale=F16, zero=F16)
    with pytest.raises(ValueError, match="CodebookCodes: dim must be a positive int"):
        krec.CodebookCodes(bits=4, dim=None, codes=U32, norm=F16, levels=LEV)


@pytest.mark.parametrize("cls,kind,kw,view", CASES, ids=IDS)
def test_missing_or_wrong_arrays_are_refused(cls, kind, kw, view):
    arrays = [n for n, v in kw.items() if isinstance(v, mx.array)]
    for name in arrays:
        with pytest.raises(TypeError, match=name):  # left out
            cls(**{k: v for k, v in kw.items() if k != name})
        with pytest.raises(ValueError, match=f"{cls.__name__}: {name} is required"):
            cls(**{**kw, name: None})
        with pytest.raises(TypeError, match=f"{name} must be an mx.array, got list"):
            cls(**{**kw, name: [0, 1]})
    with pytest.raises(TypeError, match="unexpected keyword"):
        cls(**kw, kind=krec.AFFINE)  # the kind is the class's


def test_records_refuse_what_their_layout_does_not_hold():
    with pytest.raises(ValueError, match="signs and rnorm go together"):
        krec.CodebookCodes(bits=4, dim=128, codes=U32, norm=F16, levels=LEV, signs=U32)
    with pytest.raises(ValueError, match="go together"):  # via replace: checked again
        dataclasses.replace(krec.CodebookCodes(**CASES[2][2], signs=U32, rnorm=F16), rnorm=None)
    with pytest.raises(TypeError, match="rnorm must be an mx.array"):
        krec.CodebookCodes(bits=4, dim=128, codes=U32, norm=F16, levels=LEV, signs=U32, rnorm=1.0)
    with pytest.raises(TypeError, match="signs"):
        krec.AffineCodes(bits=4, group=64, codes=U32, scale=F16, zero=F16, signs=U32)


def test_records_have_one_home():
    """The record classes are exported by velox_core.kernels.records alone."""
    from velox_core.kernels import layout

    names = [c[0].__name__ for c in CASES] + ["CodeRecord"]
    for name in names:
        assert name in records.__all__ and name not in dk.__all__ + layout.__all__
    assert not hasattr(dk, "Codes") and not hasattr(layout, "Codes")


def test_codebook_codes_for_another_head_dim_are_refused():
    from velox_core.kernels.layout import check_codes

    codes = mx.zeros((1, 1, 4, 128 * 4 // 32), mx.uint32)
    cb = krec.CodebookCodes(bits=4, dim=128, codes=codes, norm=F16, levels=LEV)
    check_codes("key", cb, 1, 1, 4, 128)
    wrong = dataclasses.replace(cb, dim=96)
    with pytest.raises(ValueError, match="head dim 96, the segment's is 128"):
        check_codes("key", wrong, 1, 1, 4, 128)


# -- the layouts: how the kernels read each record class ------------------------------------------


def test_every_core_record_has_its_registered_layout():
    from velox_core.kernels import layout as lay

    for cls, kind, kw, _ in CASES:
        got = lay.layout_of(cls(**kw))
        assert got.record is cls and got.kind == kind == cls.kind
        assert lay.layout_for(kind) is got
    names = [x.name for x in lay.layouts()]
    assert len(set(names)) == len(names)
    assert [x.kind for x in lay.layouts()] == sorted(x.kind for x in lay.layouts())


def test_a_record_without_a_layout_is_refused_by_name():
    from velox_core.kernels import layout as lay

    @dataclasses.dataclass(slots=True, kw_only=True)
    class Orphan(records.CodeRecord):
        kind = 99
        bits: int = 4

    with pytest.raises(TypeError, match="no decode kernel layout reads Orphan"):
        lay.layout_of(Orphan())
    with pytest.raises(ValueError, match="Orphan already|kind 99|Orphan.kind"):

        class Wrong(lay.Layout):
            kind = 98  # not the record's
            record = Orphan
            name = "orphan"

        lay.register_layout(Wrong())
    assert lay.layout_for(98) is None and lay.layout_for(99) is None


def test_registering_takes_no_second_layout_for_a_kind_or_a_name():
    from velox_core.kernels import layout as lay

    class Again(lay.AffineLayout):
        pass

    with pytest.raises(ValueError, match="kind 0 is AffineLayout's"):
        lay.register_layout(Again())
    assert lay.register_layout(lay.AffineLayout()) is lay.layout_for(krec.AFFINE)  # a no-op

    @dataclasses.dataclass(slots=True, kw_only=True)
    class Named(records.CodeRecord):
        kind = 97

    class Taken(lay.Layout):
        kind = 97
        record = Named
        name = "affine"

    with pytest.raises(ValueError, match="name 'affine' is taken"):
        lay.register_layout(Taken())
    with pytest.raises(TypeError, match="expected a Layout"):
        lay.register_layout(object())
