"""core.data.bad_samples: the policy's values, the skip/stop decision, load-time substitution and the count;
the
registry and config schema spell the policy flat in each data section."""

from __future__ import annotations

import pytest

from core.data.bad_samples import BadSample, BadSamplePolicy, BadSamples, count_since, mark
from core.errors import ConfigError, DataError
from core.registry import Registry
from tests.helpers import fault


@pytest.mark.parametrize(
    "kw", [{"on_bad_sample": "maybe"}, {"max_bad_fraction": 2}, {"max_bad_fraction": -0.1}]
)
def test_unknown_policy_values_are_config_errors(kw: dict) -> None:
    with pytest.raises(ConfigError):
        BadSamplePolicy(**kw)


def test_skip_under_the_fraction_stop_past_it_and_error_at_the_first() -> None:
    start = mark()
    ok = BadSamples(BadSamplePolicy(max_bad_fraction=0.1), "split 'train'")
    ok.add("a.jpg", "truncated")
    ok.check(10)  # 1 of 10 is not more than 10%
    assert ok.count == 1 and count_since(start) == 1
    over = BadSamples(BadSamplePolicy(max_bad_fraction=0.1), "split 'train'")
    over.add("a.jpg", "truncated")
    over.add("b.jpg", "truncated")
    with pytest.raises(DataError) as e:
        over.check(10)
    assert fault(e.value) == ("data.max_bad_fraction", "2/10", ("<= 0.1",))
    strict = BadSamples(BadSamplePolicy(on_bad_sample="error"), "split 'val'")
    with pytest.raises(DataError) as e:
        strict.add("c.jpg", "truncated")
    assert fault(e.value) == ("sample", "c.jpg", ())


def test_load_substitutes_the_next_good_sample_and_counts_the_bad_one() -> None:
    bad = BadSamples(BadSamplePolicy(max_bad_fraction=0.5), "split 'train'")
    bad.check(4)

    def read(i: int) -> int:
        if i in (1, 3):
            raise BadSample("silent")
        return i * 10

    assert [bad.load(i, read, str) for i in range(4)] == [0, 20, 20, 0]  # 3 wraps around to 0
    assert bad.count == 2
    strict = BadSamples(BadSamplePolicy(on_bad_sample="error"), "split 'train'")
    strict.check(4)
    with pytest.raises(DataError) as e:
        strict.load(1, read, lambda i: f"sample-{i}")
    assert fault(e.value) == ("sample", "sample-1", ())
    tight = BadSamples(BadSamplePolicy(max_bad_fraction=0.3), "split 'train'")
    tight.check(4)
    tight.load(1, read, str)
    with pytest.raises(DataError) as e:  # the second of 4 is past 30%
        tight.load(3, read, str)
    assert fault(e.value) == ("data.max_bad_fraction", "2/4", ("<= 0.3",))


def test_the_registry_gathers_a_dataclass_parameters_flat_keys() -> None:
    reg: Registry = Registry("data")

    @reg.register("files")
    def files(*, root: str = "", policy: BadSamplePolicy = BadSamplePolicy()) -> BadSamplePolicy:  # noqa: B008
        return policy

    assert reg.build_section({"name": "files", "on_bad_sample": "error"}).on_bad_sample == "error"
    assert reg.build("files") == BadSamplePolicy()
    with pytest.raises(ConfigError) as e:
        reg.check_section({"name": "files", "max_bad_fraction": 2})
    assert fault(e.value)[:2] == ("data.max_bad_fraction", "2")


def test_every_data_schema_has_the_policy_keys_with_their_one_default() -> None:
    import dataclasses

    from core.registry import DATASETS
    from recipes.cli.config import schema_from_builder

    for name in DATASETS.names():
        fields = {
            f.name: f.default
            for f in dataclasses.fields(schema_from_builder("data", name, DATASETS.get(name)))
        }
        assert fields["on_bad_sample"] == "skip" and fields["max_bad_fraction"] == 0.01, name
        assert "policy" not in fields
