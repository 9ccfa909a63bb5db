import pytest

from tests.models.helpers import tiny_policy


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("policy") / "pretrained_model"
    tiny_policy().save_pretrained(path)
    return str(path)


@pytest.fixture(autouse=True)
def markers(tmp_path, monkeypatch):
    monkeypatch.setenv("ROBOSCALE_FAKE_ENV_MARKERS", str(tmp_path))  # spawned workers inherit it
