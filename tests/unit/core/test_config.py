"""Settings: flags beat service env beats generic env beats defaults; bad values fail naming the source."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from kvmesh.core.config import ServerSettings, load_settings, setting
from kvmesh.services.worker.settings import WorkerSettings

pytestmark = pytest.mark.unit


@dataclass(frozen=True)
class DemoSettings(ServerSettings):
    workers: list[str] = setting([], "worker addresses")
    ratio: float = setting(0.5, "a ratio")
    enabled: bool = setting(False, "a switch")
    limit: int | None = setting(None, "optional limit")


def test_defaults() -> None:
    s = load_settings(DemoSettings, [], env={}, service="demo")
    assert (s.port, s.host, s.workers, s.ratio, s.enabled, s.limit) == (0, "127.0.0.1", [], 0.5, False, None)


def test_precedence_flag_then_service_env_then_env() -> None:
    env = {"KVMESH_PORT": "1000", "KVMESH_DEMO_PORT": "2000", "KVMESH_RATIO": "0.25"}
    assert load_settings(DemoSettings, [], env=env, service="demo").port == 2000
    assert load_settings(DemoSettings, ["--port", "3000"], env=env, service="demo").port == 3000
    assert load_settings(DemoSettings, [], env=env, service="demo").ratio == 0.25
    assert load_settings(DemoSettings, [], env={"KVMESH_PORT": "1000"}, service="demo").port == 1000


def test_types_are_converted() -> None:
    s = load_settings(DemoSettings, ["--workers", "a:1, b:2", "--enabled", "yes", "--limit", "7"], env={})
    assert s.workers == ["a:1", "b:2"] and s.enabled is True and s.limit == 7


def test_bad_value_names_flag_and_variable(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        load_settings(DemoSettings, [], env={"KVMESH_DEMO_PORT": "eighty"}, service="demo")
    assert "KVMESH_DEMO_PORT" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        load_settings(DemoSettings, ["--enabled", "maybe"], env={})
    assert "--enabled" in capsys.readouterr().err


@dataclass(frozen=True)
class ListSettings(ServerSettings):
    targets: tuple[str, ...] = setting((), "addresses")
    sizes: tuple[int, ...] = setting((), "sizes")


def test_list_settings_are_tuples_from_commas_or_a_yaml_list() -> None:
    assert load_settings(ListSettings, [], env={}).targets == ()
    s = load_settings(ListSettings, ["--targets", "a:1, b:2,", "--sizes", "[16, 32]"], env={})
    assert s.targets == ("a:1", "b:2") and s.sizes == (16, 32)
    repeated = load_settings(ListSettings, ["--targets", "a:1", "--targets", "b:2,c:3"], env={})
    assert repeated.targets == ("a:1", "b:2", "c:3")
    env = {"KVMESH_DEMO_TARGETS": '["c:3", "d:4"]'}
    assert load_settings(ListSettings, [], env=env, service="demo").targets == ("c:3", "d:4")


def test_a_yaml_value_that_is_not_a_list_fails(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        load_settings(ListSettings, ["--targets", "[a"], env={})
    assert "--targets" in capsys.readouterr().err


def test_a_settings_class_s_own_check_is_a_one_line_error_naming_the_flag(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        load_settings(WorkerSettings, ["--role", "prefil"], env={}, service="worker")
    assert exc.value.code == 2
    assert "error: --role: 'prefil' is not one of both, prefill, decode" in capsys.readouterr().err
    assert load_settings(WorkerSettings, ["--role", "decode"], env={}, service="worker").worker_role.value == "decode"
