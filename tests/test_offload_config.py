import dataclasses
import math
import os
import re
import subprocess
import sys
import warnings

import pytest

from hf_prefetch import OffloadConfig, PrefetchConfig, UVAConfig
from hf_prefetch import config as offload_config
from hf_prefetch.config import resolve_offload


@pytest.fixture(autouse=True)
def fresh_warnings(monkeypatch):
    # Warnings are given once per process; every test starts from none given.
    monkeypatch.setattr(offload_config, "_warned", set())


@pytest.mark.parametrize(
    "build, match",
    [
        (lambda: UVAConfig(cpu_offload_gb=-1), r"cpu_offload_gb=-1 must be a number of GiB >= 0"),
        (lambda: UVAConfig(cpu_offload_gb=float("nan")), r"cpu_offload_gb=nan must be a number"),
        (lambda: UVAConfig(cpu_offload_gb="8GiB"), r"cpu_offload_gb='8GiB' must be a number of GiB"),
        (lambda: UVAConfig(cpu_offload_gb=True), r"cpu_offload_gb=True must be a number"),
        (lambda: UVAConfig(cpu_offload_params="mlp"), r"UVAConfig.cpu_offload_params='mlp' is a string; .*\{'mlp'\}"),
        (lambda: UVAConfig(cpu_offload_params={".mlp"}), r"UVAConfig.cpu_offload_params contains '.mlp'"),
        (lambda: OffloadConfig(backend="disk"), r"OffloadConfig.backend='disk' must be one of \['auto', 'uva', 'pre"),
        (lambda: OffloadConfig(uva={"cpu_offload_gb": 8}), r"OffloadConfig.uva=.* must be a hf_prefetch.UVAConfig"),
        (lambda: OffloadConfig(prefetch="2/1/2"), r"OffloadConfig.prefetch='2/1/2' must be a hf_prefetch.Prefetch"),
        (lambda: OffloadConfig(backend="uva"), r"backend='uva'\) needs uva.cpu_offload_gb > 0"),
        (
            lambda: OffloadConfig(backend="uva", uva=UVAConfig(cpu_offload_params={"mlp"})),
            r"backend='uva'\) needs uva.cpu_offload_gb > 0",
        ),
        (
            lambda: OffloadConfig(uva=UVAConfig(cpu_offload_params={"mlp"})),
            r"cpu_offload_params=\{'mlp'\} chooses which parameters UVA may take, but cpu_offload_gb=0 takes none",
        ),
    ],
)
def test_invalid_configs_name_field_value_and_fix(build, match):
    with pytest.raises(ValueError, match=match):
        build()


# (config, the warning it gives or None, the backend it selects)
WARNING_TABLE = [
    (lambda: OffloadConfig(), None, None),
    (lambda: OffloadConfig(uva=UVAConfig(cpu_offload_gb=4)), None, "uva"),
    (lambda: OffloadConfig(prefetch=PrefetchConfig(group_size=4)), None, "prefetch"),
    (lambda: OffloadConfig(backend="uva", uva=UVAConfig(cpu_offload_gb=4)), None, "uva"),
    (lambda: OffloadConfig(backend="prefetch"), None, "prefetch"),
    (
        lambda: OffloadConfig(prefetch=PrefetchConfig(), uva=UVAConfig(cpu_offload_gb=4)),
        r"backend='auto'\) has both prefetch and uva=.* it selects prefetch and ignores uva",
        "prefetch",
    ),
    (
        lambda: OffloadConfig(prefetch=PrefetchConfig(), uva=UVAConfig(cpu_offload_params={"mlp"})),
        r"backend='auto'\) has both prefetch and uva=",
        "prefetch",
    ),
    (
        lambda: OffloadConfig(backend="uva", uva=UVAConfig(cpu_offload_gb=4), prefetch=PrefetchConfig()),
        r"backend='uva'\) ignores prefetch=PrefetchConfig\(group_size=2",
        "uva",
    ),
    (
        lambda: OffloadConfig(backend="prefetch", uva=UVAConfig(cpu_offload_gb=4)),
        r"backend='prefetch'\) ignores uva=UVAConfig\(cpu_offload_gb=4.0",
        "prefetch",
    ),
    (
        lambda: OffloadConfig(backend="prefetch", uva=UVAConfig(cpu_offload_params={"mlp"})),
        r"backend='prefetch'\) ignores uva=",
        "prefetch",
    ),
]


@pytest.mark.parametrize("build, warning, selected", WARNING_TABLE)
def test_warning_table_and_selected_backend(build, warning, selected):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        config = build()
        build()
    messages = [str(w.message) for w in caught]
    assert config.selected == selected
    if warning is None:
        assert messages == []
    else:
        assert len(messages) == 1, messages  # once, although built twice
        assert re.search(warning, messages[0]), messages[0]
        assert caught[0].filename == __file__  # points at the caller, not at the library


def test_prefetch_backend_without_prefetch_means_the_default_prefetch_config():
    assert OffloadConfig(backend="prefetch").prefetch == PrefetchConfig()
    assert OffloadConfig(backend="prefetch") == OffloadConfig(backend="prefetch", prefetch=PrefetchConfig())
    assert OffloadConfig().prefetch is None


def test_configs_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        OffloadConfig().backend = "uva"
    with pytest.raises(dataclasses.FrozenInstanceError):
        UVAConfig().cpu_offload_gb = 1.0


# A config with every field away from its default, and one variant per field that changes only that field.
with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # BASE sets both backends
    BASE = OffloadConfig(
        backend="uva",
        uva=UVAConfig(cpu_offload_gb=1.5, cpu_offload_params={"mlp", "experts", "self_attn.o_proj", "a", "b", "c"}),
        prefetch=PrefetchConfig(group_size=4, num_in_group=2, prefetch_step=3, offload_params={"x", "y", "z", "w"}),
    )
    FIELD_VARIANTS = {
        "OffloadConfig.backend": dataclasses.replace(BASE, backend="auto"),
        "OffloadConfig.uva": dataclasses.replace(BASE, uva=UVAConfig(cpu_offload_gb=2)),
        "OffloadConfig.prefetch": dataclasses.replace(BASE, prefetch=None),
        "UVAConfig.cpu_offload_gb": dataclasses.replace(
            BASE, uva=dataclasses.replace(BASE.uva, cpu_offload_gb=1.5000001)
        ),
        "UVAConfig.cpu_offload_params": dataclasses.replace(
            BASE, uva=dataclasses.replace(BASE.uva, cpu_offload_params=BASE.uva.cpu_offload_params - {"c"})
        ),
        "PrefetchConfig.group_size": dataclasses.replace(
            BASE, prefetch=dataclasses.replace(BASE.prefetch, group_size=5)
        ),
        "PrefetchConfig.num_in_group": dataclasses.replace(
            BASE, prefetch=dataclasses.replace(BASE.prefetch, num_in_group=3)
        ),
        "PrefetchConfig.prefetch_step": dataclasses.replace(
            BASE, prefetch=dataclasses.replace(BASE.prefetch, prefetch_step=2)
        ),
        "PrefetchConfig.offload_params": dataclasses.replace(
            BASE, prefetch=dataclasses.replace(BASE.prefetch, offload_params={"x", "y", "z", "v"})
        ),
        "PrefetchConfig.routed_experts": dataclasses.replace(
            BASE, prefetch=dataclasses.replace(BASE.prefetch, routed_experts=False)
        ),
        "PrefetchConfig.expert_cache": dataclasses.replace(
            BASE, prefetch=dataclasses.replace(BASE.prefetch, expert_cache=4)
        ),
        "PrefetchConfig.routed_max_tokens": dataclasses.replace(
            BASE, prefetch=dataclasses.replace(BASE.prefetch, routed_max_tokens=3)
        ),
        "PrefetchConfig.recent_experts": dataclasses.replace(
            BASE, prefetch=dataclasses.replace(BASE.prefetch, recent_experts=False)
        ),
        "PrefetchConfig.cpu_experts": dataclasses.replace(
            BASE, prefetch=dataclasses.replace(BASE.prefetch, cpu_experts="auto")
        ),
        "PrefetchConfig.compress": dataclasses.replace(
            BASE, prefetch=dataclasses.replace(BASE.prefetch, compress=True)
        ),
        "PrefetchConfig.compute_seconds": dataclasses.replace(
            BASE, prefetch=dataclasses.replace(BASE.prefetch, compute_seconds={"model.layers.0": 0.001})
        ),
    }


def test_hash_variants_cover_every_field():
    # A field added to any of the three configs must get a variant here (and so be shown to change the hash).
    every_field = {
        f"{cls.__name__}.{f.name}"
        for cls in (OffloadConfig, UVAConfig, PrefetchConfig)
        for f in dataclasses.fields(cls)
    }
    assert set(FIELD_VARIANTS) == every_field


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("changed", sorted(FIELD_VARIANTS))
def test_changing_any_field_changes_the_hash(changed):
    variant = FIELD_VARIANTS[changed]
    assert variant != BASE
    assert variant.compute_hash() != BASE.compute_hash()


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_equal_configs_hash_equal():
    digest = BASE.compute_hash()
    assert len(digest) == 64 and int(digest, 16) >= 0  # sha256, hex
    same = OffloadConfig(
        backend="uva",
        uva=UVAConfig(cpu_offload_gb=1.5, cpu_offload_params=["c", "b", "a", "self_attn.o_proj", "experts", "mlp"]),
        prefetch=PrefetchConfig(group_size=4, num_in_group=2, prefetch_step=3, offload_params=["w", "z", "y", "x"]),
    )
    assert same.compute_hash() == digest
    assert (
        OffloadConfig(uva=UVAConfig(cpu_offload_gb=8)).compute_hash()
        == OffloadConfig(uva=UVAConfig(cpu_offload_gb=8.0)).compute_hash()
    )
    default_prefetch = OffloadConfig(backend="prefetch", prefetch=PrefetchConfig())
    assert OffloadConfig(backend="prefetch").compute_hash() == default_prefetch.compute_hash()


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_hash_is_the_same_in_other_processes():
    # String hashing is salted per process (PYTHONHASHSEED), so set iteration order differs between processes: the
    # digest must not depend on it.
    code = (
        "import warnings; warnings.simplefilter('ignore')\n"
        "from hf_prefetch import OffloadConfig, PrefetchConfig, UVAConfig\n"
        "print(OffloadConfig(backend='uva', uva=UVAConfig(cpu_offload_gb=1.5, cpu_offload_params={'mlp', 'experts', "
        "'self_attn.o_proj', 'a', 'b', 'c'}), prefetch=PrefetchConfig(group_size=4, num_in_group=2, prefetch_step=3, "
        "offload_params={'x', 'y', 'z', 'w'})).compute_hash())\n"
    )
    digests = set()
    for seed in ("1", "2", "3"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        digests.add(result.stdout.strip())
    assert digests == {BASE.compute_hash()}


@pytest.mark.parametrize(
    "offload, expected",
    [
        ("prefetch", PrefetchConfig()),
        (PrefetchConfig(group_size=3), PrefetchConfig(group_size=3)),
        (UVAConfig(cpu_offload_gb=3), UVAConfig(cpu_offload_gb=3)),
        (UVAConfig(1, frozenset({"mlp"})), UVAConfig(cpu_offload_gb=1, cpu_offload_params={"mlp"})),
        (OffloadConfig(uva=UVAConfig(cpu_offload_gb=5)), UVAConfig(cpu_offload_gb=5)),
        (OffloadConfig(prefetch=PrefetchConfig(group_size=6)), PrefetchConfig(group_size=6)),
        (OffloadConfig(backend="prefetch"), PrefetchConfig()),
    ],
)
def test_resolve_offload(offload, expected):
    assert resolve_offload(offload) == expected


@pytest.mark.parametrize(
    "offload, match",
    [
        ("disk", r"offload='disk' is not supported; use 'prefetch'"),
        ("uva", r"UVA backend with cpu_offload_gb=0 keeps nothing in host memory"),
        (UVAConfig(), r"cpu_offload_gb=0 keeps nothing"),
        (OffloadConfig(), r"OffloadConfig\(\) selects no backend"),
        (None, r"offload=None is not supported"),
    ],
)
def test_resolve_offload_errors(offload, match):
    with pytest.raises(ValueError, match=match):
        resolve_offload(offload)


@pytest.mark.parametrize(
    "make, same",
    [
        (lambda: UVAConfig(cpu_offload_gb=-0.0), lambda: UVAConfig(cpu_offload_gb=0.0)),
        (lambda: UVAConfig(cpu_offload_gb=8), lambda: UVAConfig(cpu_offload_gb=8.0)),
        (lambda: PrefetchConfig(offload_params=["b", "a"]), lambda: PrefetchConfig(offload_params={"a", "b"})),
        (
            lambda: OffloadConfig(backend="uva", uva=UVAConfig(cpu_offload_gb=1)),
            lambda: OffloadConfig(backend="uva", uva=UVAConfig(cpu_offload_gb=1.0)),
        ),
    ],
)
def test_equal_configs_hash_equally(make, same):
    assert make() == same()
    assert make().compute_hash() == same().compute_hash()


def test_huge_sizes_are_a_clear_value_not_an_overflow():
    assert UVAConfig(cpu_offload_gb=10**400).cpu_offload_gb == math.inf
    with pytest.raises(ValueError, match=r"offload_params=None must be a set of parameter-name segments"):
        PrefetchConfig(offload_params=None)
    with pytest.raises(ValueError, match=r"cpu_offload_params=None must be a set"):
        UVAConfig(cpu_offload_gb=1, cpu_offload_params=None)
