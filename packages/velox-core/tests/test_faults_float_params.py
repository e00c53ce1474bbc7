"""Every float parameter of every registered method refuses NaN and +-inf (issue 55).

``uniform:clip=nan`` and ``skvq:clip_min=nan`` were accepted (a NaN passes every range
comparison) and gave NaN logits. The cases are every float-annotated field of every installed
method's config, so a method added later is covered without editing this file.
"""

import dataclasses
import math

import pytest

from velox_core import Uniform, make, methods
from velox_core.validation import check_finite_params, check_float

BAD = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


def _float_fields():
    out = []
    for name, m in methods().items():
        config = getattr(m.cache_class, "Config", None)
        assert config is not None, f"{name}: its cache class has no Config to enumerate"
        for f in dataclasses.fields(config):
            if "float" in str(f.type):
                out.append((name, f.name, f.default, str(f.type)))
    return out


FIELDS = _float_fields()


def _bad_value(default, annotation, bad):
    if annotation.startswith("tuple"):  # e.g. nestedkv's prior=(0.4, 0.4, 0.2)
        return (bad, *default[1:]), r"\[0\]"
    return bad, ""


def test_the_known_cases_are_enumerated():
    names = {(m, p) for m, p, _, _ in FIELDS}
    assert ("uniform", "clip") in names
    if "skvq" in methods():
        assert ("skvq", "clip_min") in names


@pytest.mark.parametrize("text", list(BAD))
@pytest.mark.parametrize(
    ("method", "param", "default", "annotation"), FIELDS, ids=[f"{m}-{p}" for m, p, _, _ in FIELDS]
)
def test_non_finite_float_parameter_is_refused(method, param, default, annotation, text):
    value, suffix = _bad_value(default, annotation, BAD[text])
    with pytest.raises(ValueError, match=rf"{param}{suffix} must be a finite number"):
        make(method, **{param: value})
    if not annotation.startswith("tuple"):  # the same through a spec string, as the CLI has it
        with pytest.raises(ValueError, match=rf"{param} must be a finite number"):
            make(f"{method}:{param}={text}")


def test_saved_config_with_nan_is_refused_on_rebuild():
    cache = make("uniform:clip=0.9")
    config = cache.config()
    config["clip"] = math.nan
    with pytest.raises(ValueError, match="clip must be a finite number"):
        type(cache).from_config(config)


def test_check_float_refuses_non_finite_even_without_bounds():
    for v in BAD.values():
        with pytest.raises(ValueError, match="x must be a finite number"):
            check_float("x", v)
        with pytest.raises(ValueError, match="x must be a finite number"):
            check_float("x", v, minimum=0.0, maximum=1.0)
    assert check_float("x", math.inf, finite=False) == math.inf
    with pytest.raises(ValueError, match="finite"):
        check_float("x", math.nan, finite=False)  # NaN never


def test_codec_refuses_nan_clip():
    with pytest.raises(ValueError, match="clip must be a finite number"):
        Uniform(4, 64, "token", math.nan)


def test_finite_params_check_leaves_other_values_alone():
    check_finite_params("m", {"a": 1, "b": 0.5, "c": None, "d": "token", "e": True, "f": (1.0,)})
    with pytest.raises(ValueError, match=r"m: f\[1\] must be a finite number"):
        check_finite_params("m", {"f": [1.0, math.nan]})
