"""Shared fixtures: the shipped model exported once per session as a transformers checkpoint."""
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WEIGHTS = os.path.join(ROOT, "models", "kvtier-tiny.safetensors")


@pytest.fixture(scope="session")
def hf_dir(tmp_path_factory):
    from kvtier.tools.export_hf import export

    out = tmp_path_factory.mktemp("kvtier-tiny-hf")
    export(WEIGHTS, str(out))
    return str(out)


@pytest.fixture(scope="session")
def hf_model(hf_dir):
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(hf_dir, attn_implementation="eager").eval()
