"""The one door to Ray's internals: each capability runs only on the Ray releases it is known on and
where the switch leaves it on; a setting the installed Ray cannot honour is refused, naming the release."""

from __future__ import annotations

import pytest

from raytrain_ddp import load_config, ray_compat
from raytrain_ddp.preflight.checks import check_ray_release


@pytest.fixture
def ray_2_60(monkeypatch):
    """Ray 2.60 as far as ray_compat can tell, whichever Ray runs the test (make test-ray-floor's too)."""
    monkeypatch.setattr(ray_compat, "ray_release", lambda: (2, 60))


def test_the_release_is_the_installed_rays_read_without_importing_it():
    import ray

    assert ray_compat.ray_release() == tuple(int(part) for part in ray.__version__.split(".")[:2])


def test_every_capability_runs_on_ray_2_60_and_none_with_the_switch_off(monkeypatch, ray_2_60):
    monkeypatch.delenv(ray_compat.SWITCH_ENV, raising=False)
    assert all(ray_compat.states().values())
    monkeypatch.setenv(ray_compat.SWITCH_ENV, "off")
    assert not any(ray_compat.states().values())


def test_one_capability_is_switched_off_by_name_and_an_unknown_name_is_an_error(monkeypatch, ray_2_60):
    monkeypatch.setenv(ray_compat.SWITCH_ENV, "-prestart, -lean_trainer")
    states = ray_compat.states()
    assert [name for name, on in states.items() if not on] == ["prestart", "lean_trainer"]
    with pytest.raises(KeyError, match="unknown Ray capability 'prestrat'"):
        ray_compat.enabled("prestrat")


@pytest.mark.parametrize(("release", "recounts", "others"), [((2, 55), False, True), ((2, 61), False, False)])
def test_a_ray_release_outside_a_capabilitys_range_takes_the_public_path(monkeypatch, release, recounts, others):
    monkeypatch.delenv(ray_compat.SWITCH_ENV, raising=False)
    monkeypatch.setattr(ray_compat, "ray_release", lambda: release)
    states = ray_compat.states()
    assert states.pop("elastic_recount") is recounts  # Ray 2.60's coordinator alone recounts on request
    assert set(states.values()) == {others}


def test_a_setting_the_installed_ray_cannot_honour_is_refused_naming_the_release(monkeypatch, ray_2_60):
    config = load_config("image_folder", overrides=["data.label_selector={role: data}", "dataset.path=/data"])
    assert check_ray_release(config) == []
    monkeypatch.setattr(ray_compat, "ray_release", lambda: (2, 55))
    [problem] = check_ray_release(config)
    assert problem.startswith("data.label_selector needs Ray 2.56 or newer")
    assert "this is Ray 2.55: upgrade Ray, or unset data.label_selector" in problem
    assert check_ray_release(load_config("image_folder", overrides=["dataset.path=/data"])) == []
