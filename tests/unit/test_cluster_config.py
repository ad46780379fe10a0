"""The `ray up` configs (cluster.yaml for AWS, cluster-local.yaml for listed hosts) pass what `ray up`
itself does to a config before it touches a machine: Ray's defaults filled in (`prepare_config`), then
Ray's cluster-config schema (`validate_config`), which rejects an unknown or misspelled key. Fast: no
cluster, no cloud. tests/system/test_ray_up.py runs cluster-local.yaml for real.

    .venv/bin/pytest tests/unit/test_cluster_config.py
"""

from __future__ import annotations

import copy
import re
from pathlib import Path

import jsonschema
import pytest
import yaml
from ray.autoscaler._private.util import prepare_config, validate_config

ROOT = Path(__file__).parents[2]
CONFIGS = ["cluster.yaml", "cluster-local.yaml"]


def load(name: str) -> dict:
    return yaml.safe_load((ROOT / name).read_text())


def ray_up_checks(config: dict) -> dict:
    """The config as `ray up` would use it (Ray's defaults filled in), or Ray's schema error."""
    prepared = prepare_config(copy.deepcopy(config))
    validate_config(prepared)
    return prepared


def misspell(config: dict, *path: str) -> dict:
    """A copy of `config` with the key at `path` misspelled (its last letter dropped), value kept."""
    bad = copy.deepcopy(config)
    *parents, key = path
    section = bad
    for parent in parents:
        section = section[parent]
    section[key[:-1]] = section.pop(key)
    return bad


@pytest.mark.parametrize("name", CONFIGS)
def test_config_passes_rays_schema_and_defaults(name):
    config = ray_up_checks(load(name))

    assert config["cluster_name"] and config["head_node_type"] in config["available_node_types"]
    for remote, local in load(name)["file_mounts"].items():  # every file it ships exists
        assert local.startswith("~") or (ROOT / local).exists(), (
            f"file_mounts: {remote}: {local} is not in the repository"
        )


@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.parametrize(
    "path",
    [("setup_commands",), ("head_start_ray_commands",), ("file_mounts",), ("auth", "ssh_user")],
    ids=".".join,
)
def test_a_misspelled_key_is_rejected(name, path):
    with pytest.raises(jsonschema.ValidationError, match=f"'{path[-1][:-1]}' was unexpected"):
        ray_up_checks(misspell(load(name), *path))


def test_a_misspelled_node_type_key_is_rejected():
    with pytest.raises(jsonschema.ValidationError, match="'min_worker' was unexpected"):
        ray_up_checks(misspell(load("cluster.yaml"), "available_node_types", "gpu", "min_workers"))


def test_aws_node_configs_are_valid_ec2_launch_arguments():
    """Ray passes node_config to EC2's RunInstances as is, and its schema does not look inside:
    botocore's model of that call does, at every depth."""
    import botocore.session
    from botocore.exceptions import ParamValidationError
    from botocore.validate import validate_parameters

    run_instances = botocore.session.get_session().get_service_model("ec2").operation_model("RunInstances")
    config = load("cluster.yaml")
    for node_type in config["available_node_types"].values():
        validate_parameters({**node_type["node_config"], "MinCount": 1, "MaxCount": 1}, run_instances.input_shape)

    ebs = misspell(config, "available_node_types", "gpu", "node_config", "BlockDeviceMappings")
    with pytest.raises(ParamValidationError, match='Unknown parameter in input: "BlockDeviceMapping"'):
        validate_parameters(
            {**ebs["available_node_types"]["gpu"]["node_config"], "MinCount": 1, "MaxCount": 1},
            run_instances.input_shape,
        )


@pytest.mark.parametrize("name", CONFIGS)
def test_token_auth_idle_workers_kept_a_loopback_dashboard_and_a_head_without_workers(name):
    config = ray_up_checks(load(name))
    [head_start] = [c for c in config["head_start_ray_commands"] if "ray start" in c]
    [worker_start] = [c for c in config["worker_start_ray_commands"] if "ray start" in c]

    # The variables set on `ray start` itself, not only in .bashrc: token auth, and an idle worker process
    # kept a minute (session.OWN_RAY's setting: a lazy dataset's epochs reuse its tasks' processes).
    for setting in "RAY_AUTH_MODE=token", "RAY_idle_worker_killing_time_threshold_ms=60000":
        for start in head_start, worker_start:
            assert re.search(rf"(^|[;&|] *)(\w+=\S* )*{setting} (\w+=\S* )*ray start ", start), (setting, start)
    assert "--dashboard-host=127.0.0.1" in head_start  # reachable only through `ray dashboard` (an SSH tunnel)
    assert config["file_mounts"]["~/.ray/auth_token"] == "~/.ray/auth_token"  # the token, on every node
    head_gcs_port = re.search(r"--port=(\d+)", head_start).group(1)
    assert f"--address=$RAY_HEAD_IP:{head_gcs_port}" in worker_start
    head = config["available_node_types"][config["head_node_type"]]
    assert head["resources"].get("CPU") == 0 or "--num-cpus=0" in head_start


@pytest.mark.parametrize("name", CONFIGS)
def test_nodes_install_the_locked_environment_the_way_make_does(name):
    """`make install` on each node, and the Makefile's install is `uv sync --locked`."""
    config = load(name)

    assert "make -C ~/raytrain-ddp install" in config["setup_commands"]
    install = re.search(r"^install:.*\n((?:\t.*\n)+)", (ROOT / "Makefile").read_text(), re.M).group(1)
    assert "sync --locked" in install
    assert any('.venv/bin:$PATH"' in c and ".bashrc" in c for c in config["setup_commands"])
