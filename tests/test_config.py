import warnings

import pytest

from hf_prefetch import PrefetchConfig


@pytest.mark.parametrize(
    "fields, match",
    [
        ({"group_size": 0}, r"group_size=0 must be >= 1"),
        ({"group_size": -3}, r"group_size=-3 must be >= 1"),
        ({"group_size": 2, "num_in_group": 3}, r"num_in_group=3 must be between 1 and group_size=2"),
        ({"num_in_group": 0}, r"num_in_group=0 must be between 1"),
        ({"prefetch_step": 0}, r"prefetch_step=0 must be >= 1"),
        ({"group_size": 2.0}, r"group_size=2.0 must be an int"),
        ({"prefetch_step": True}, r"prefetch_step=True must be an int"),
        ({"offload_params": "experts"}, r"offload_params='experts' is a string; pass a set"),
        ({"offload_params": {""}}, r"contains ''"),
        ({"offload_params": {".mlp"}}, r"contains '.mlp'"),
        ({"offload_params": {"mlp."}}, r"contains 'mlp.'"),
    ],
)
def test_invalid_config_names_field_and_value(fields, match):
    with pytest.raises(ValueError, match=match):
        PrefetchConfig(**fields)


@pytest.mark.parametrize(
    "fields",
    [
        {},
        {"group_size": 1, "num_in_group": 1, "prefetch_step": 1},
        {"group_size": 8, "num_in_group": 2, "prefetch_step": 2},
        {"group_size": 4, "num_in_group": 4, "prefetch_step": 7},
        {"offload_params": ["experts", "mlp.down_proj"]},
    ],
)
def test_valid_config(fields):
    config = PrefetchConfig(**fields)
    assert isinstance(config.offload_params, frozenset)
    assert hash(config) == hash(PrefetchConfig(**fields))


def test_config_is_frozen():
    config = PrefetchConfig()
    with pytest.raises(AttributeError):
        config.group_size = 4


def test_warns_once_when_copies_have_nothing_to_hide_behind():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        PrefetchConfig(group_size=8, num_in_group=5, prefetch_step=3)
        PrefetchConfig(group_size=8, num_in_group=5, prefetch_step=3)
        PrefetchConfig(group_size=8, num_in_group=2, prefetch_step=2)
    messages = [str(w.message) for w in caught if "prefetch_step=3" in str(w.message)]
    assert len(messages) == 1
    assert "num_in_group=5" in messages[0]
    assert not any("prefetch_step=2" in str(w.message) for w in caught)


def test_the_warning_points_at_the_callers_line():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        PrefetchConfig(group_size=8, num_in_group=7, prefetch_step=6)  # this line
    (warning,) = [w for w in caught if "prefetch_step=6" in str(w.message)]
    assert warning.filename == __file__
    with open(__file__) as source:
        assert "# this line" in source.readlines()[warning.lineno - 1]
