"""`cuda_graph=true`: the Lightning training step replayed as CUDA graphs (one GPU)."""

import pytest
import torch
from test_ddp import _gpt2_summary


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_graphed_step_trains_like_the_plain_loop_and_faster(tmp_path):
    plain = _gpt2_summary(tmp_path / "plain", tmp_path, "trainer=gpu")
    graphed = _gpt2_summary(tmp_path / "graphed", tmp_path, "trainer=gpu", "cuda_graph=true")
    print(f"tokens/s: plain {plain['tokens_per_s']:.0f}, graphed {graphed['tokens_per_s']:.0f}; "
          f"peak GiB: {plain['peak_mem_GiB']:.2f}, {graphed['peak_mem_GiB']:.2f}")
    # Same seed, same batches, same kernels: only the issuing differs.
    assert graphed["train_loss"] == pytest.approx(plain["train_loss"], abs=2e-2)
    assert graphed["val_loss"] == pytest.approx(plain["val_loss"], abs=2e-2)
    assert graphed["tokens_per_s"] > plain["tokens_per_s"]
