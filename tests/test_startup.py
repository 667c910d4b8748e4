"""Start-up does each thing once: every model's tokenizer is loaded once by the driver's checks
(vocabulary, then the pre-flight's chat-template and step-0 checks share the loaded tokenizers)."""

from collections import Counter

import pytest

from test_preflight import _composed  # the topk recipe on the embedded models, run folder tmp_path/run


@pytest.mark.parametrize("mode", ["off", "cheap", "full"])
def test_prepare_loads_each_tokenizer_once(embedded, tmp_path, monkeypatch, mode):
    from transformers import AutoTokenizer

    from opd_patches import main
    from opd_patches.checks import compat

    compat.load_tokenizer.cache_clear()  # an earlier test in this process may have loaded them already
    loads = Counter()
    real = AutoTokenizer.from_pretrained.__func__

    def counted(cls, path, *args, **kwargs):  # the real loader, counted
        loads[str(path)] += 1
        return real(cls, path, *args, **kwargs)

    monkeypatch.setattr(AutoTokenizer, "from_pretrained", classmethod(counted))
    run_dir = main.prepare(_composed(embedded, tmp_path, f"opd.preflight={mode}"))
    assert loads == {str(embedded["student"]): 1, str(embedded["teacher"]): 1}, loads
    assert (run_dir / "preflight.json").exists() == (mode != "off")
